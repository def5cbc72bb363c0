"""The per-model writer: applies queued engine batches in order; a full queue drops and counts."""

from __future__ import annotations

import asyncio
import contextlib

from kvctl.core.events import Stored
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
