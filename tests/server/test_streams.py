"""The per-model writer: applies queued engine batches in order; a full queue drops and counts."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import zmq.asyncio

from kvctl.core.events import Stored, Tier
from kvctl.core.events.engine_encode import FORMATS
from kvctl.server.ingest.streams import ModelWriter
from kvctl.server.state import Fleet
from tests.support import eventually_async


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
    from kvctl.server.ingest.streams import Streams
    from kvctl.server.worker_info import WorkerInfo

    streams = Streams(Fleet())
    assert streams.start(WorkerInfo(1, 0, "default", endpoint="tcp://127.0.0.1:9"))
    stream = streams._running[(1, 0)].stream
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
    from kvctl.server.ingest.decode_process.parent import make_decoder
    from kvctl.server.ingest.streams import Streams
    from kvctl.server.worker_info import WorkerInfo
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


async def test_a_stream_that_dies_shows_failed_and_runs_again_once_it_can() -> None:
    """A stream whose socket cannot be made (the context is out of sockets, as a router out of file descriptors
    is) once stopped for good behind a normal status row; now it shows `failed` with the error, and runs
    again, with its events, once a socket is free."""
    from kvctl.core.events.engine_encode import BlockStored, encode_batch
    from kvctl.server.ingest.streams import Streams
    from kvctl.server.worker_info import WorkerInfo
    from tests.server.zmq_engine import Engine

    ours, theirs = zmq.asyncio.Context(), zmq.asyncio.Context()
    ours.set(zmq.MAX_SOCKETS, 3)  # one stream's: its SUB and the SUB's monitor pair
    engines = [Engine(theirs), Engine(theirs)]
    fleet = Fleet()
    streams = Streams(fleet, context=ours, restart_min_s=0.05)

    try:
        for worker_id, engine in enumerate(engines, 1):
            streams.start(WorkerInfo(worker_id, 0, "default", endpoint=engine.endpoint))
        await eventually_async(streams.status, "the second stream to fail", until=lambda rows: rows[1]["failures"] >= 1,
                               timeout=5)
        first, second = streams.status()
        assert (first["state"], first["failures"], first["last_error"]) == ("running", 0, None)
        assert second["state"] == "failed" and second["last_error"] == "ZMQError: Too many open files"

        await streams.stop(1)  # its socket is free: the failed stream's next run takes it
        await eventually_async(streams.status, "the failed stream to run again",
                               until=lambda rows: rows[0]["state"] == "running", timeout=5)
        await engines[1].subscribed()
        await engines[1].publish(0, encode_batch(FORMATS["vllm"], 0.0, [BlockStored([5], None, list(range(16)), 16)]))
        await eventually_async(streams.status, "its event", until=lambda rows: rows[0]["events"] == 1, timeout=5)
        assert streams.status()[0]["failures"] >= 1
    finally:
        await streams.close()
        for engine in engines:
            await engine.close()
        ours.term()
        theirs.term()


async def test_metrics_clamp_a_counter_past_u64() -> None:
    """Python's ints have no ceiling and Prometheus clients read u64: lost_batches once read
    27670116110564327476 (a seq jump to 2^64 - 1 counted as lost batches, now a jump)."""
    from prometheus_client import generate_latest

    from kvctl.server.http.metrics import Metrics
    from kvctl.server.ingest.streams import Streams
    from kvctl.server.worker_info import WorkerInfo

    fleet = Fleet()
    streams = Streams(fleet)
    assert streams.start(WorkerInfo(1, 0, "default", endpoint="tcp://127.0.0.1:9"))
    streams._running[(1, 0)].stream._lost = 27670116110564327476  # type: ignore[attr-defined]
    text = generate_latest(Metrics(fleet, streams).registry).decode()
    [line] = [x for x in text.splitlines() if x.startswith("kvctl_stream_lost_batches_total")]
    assert float(line.rsplit(" ", 1)[1]) == float(2**64 - 1)
    await streams.close()
