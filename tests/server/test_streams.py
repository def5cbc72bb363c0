"""The per-model writer: applies queued engine batches in order; a full queue drops and counts."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import zmq.asyncio

from kvctl.core.events import Stored, Tier
from kvctl.core.events.engine_encode import FORMATS
from kvctl.server.state import Fleet
from kvctl.server.streams import ModelWriter


async def test_writer_applies_in_order_and_counts_drops() -> None:
    fleet = Fleet()
    writer = ModelWriter(fleet, "default", maxsize=2)
    writer.put((1, 0), [Stored(None, [11], [1])])
    writer.put((1, 0), [Stored(11, [12], [2])])  # needs the first: order matters
    writer.put((1, 0), [Stored(12, [13], [3]), Stored(13, [14], [4])])  # queue full: dropped
    assert writer.status() == {"model": "default", "queued": 2, "capacity": 2, "dropped_batches": 1,
                               "dropped_events": 2}
    await writer.flush()
    await asyncio.sleep(0)
    assert fleet.model("default").router.index.find_matches([1, 2, 3]).scores == {(1, 0): 2}
    assert fleet.model("default").applied[("stored", "ok")] == 2
    writer.task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await writer.task


async def test_events_per_second_comes_from_successive_samples() -> None:
    from kvctl.server.state import WorkerInfo
    from kvctl.server.streams import Streams

    streams = Streams(Fleet())
    assert streams.start(WorkerInfo(1, 0, "default", endpoint="tcp://127.0.0.1:9"))
    stream, _ = streams._running[(1, 0)]
    streams.sample(10.0)
    stream._events = 50  # type: ignore[attr-defined]
    streams.sample(12.0)
    assert streams.status()[0]["events_per_s"] == 25.0
    await streams.close()


@pytest.mark.parametrize("decoder", ["inline", "process"])
async def test_a_burst_far_larger_than_the_writer_queue_waits_in_zmq_and_loses_nothing(decoder: str) -> None:
    """8 queued batches at most, 600 published at once: the stream stops reading while the writer is
    behind, so every batch is applied and none is dropped or lost."""
    from kvctl.core.events.engine_encode import BlockStored, encode_batch
    from kvctl.server.decoder import make_decoder
    from kvctl.server.state import WorkerInfo
    from kvctl.server.streams import Streams
    from tests.server.zmq_engine import Engine

    fmt = FORMATS["vllm"]
    ctx = zmq.asyncio.Context()
    engine = Engine(ctx)
    fleet = Fleet()
    streams = Streams(fleet, queue_batches=8, decoder=make_decoder(decoder))
    try:
        streams.start(WorkerInfo(1, 0, "default", endpoint=engine.endpoint, replay_endpoint=engine.replay_endpoint))
        await engine.subscribed()
        parent = None
        for seq in range(600):
            hashes = [seq * 4 + k + 1 for k in range(4)]
            tokens = list(range(seq * 64, seq * 64 + 64))
            await engine.publish(seq, encode_batch(fmt, 0.0, [BlockStored(hashes, parent, tokens, 16)]))
            parent = hashes[-1]
        index = fleet.model("default").router.index
        deadline = asyncio.get_running_loop().time() + 20
        while index.stats()[Tier.device].blocks < 2400:
            assert asyncio.get_running_loop().time() < deadline, streams.status()
            await asyncio.sleep(0.01)
        (row,) = streams.status()
        assert (row["lost_batches"], row["decode_errors"], streams.queues()[0]["dropped_batches"]) == (0, {}, 0)
    finally:
        await streams.close()
        await engine.close()
        ctx.term()
