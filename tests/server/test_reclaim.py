"""The router gives freed index memory back while no event waits, and never while one does."""

from __future__ import annotations

import asyncio
import time

from kvctl.core.events import Removed, RouterEvent, Stored
from kvctl.server import daemon
from kvctl.server.ingest.streams import Streams
from kvctl.server.state import Fleet


def churned_fleet() -> Fleet:
    """One worker stored 40 requests of 64 blocks and evicted 30 of them."""
    fleet = Fleet()
    events = []
    for n in range(40):
        hashes = [n * 1000 + k + 1 for k in range(64)]
        events.append(RouterEvent(1, Stored(None, hashes, hashes)))
        if n < 30:
            events.append(RouterEvent(1, Removed(hashes[::-1])))
    fleet.apply("default", sorted(events, key=lambda e: type(e.data) is Removed), 0.0)
    return fleet


async def test_freed_memory_is_given_back_when_nothing_waits() -> None:
    fleet = churned_fleet()
    streams = Streams(fleet)
    assert fleet.reclaim_debt() > 0
    await daemon.reclaim_when_idle(fleet, streams)
    assert fleet.reclaim_debt() == 0
    assert fleet.stats("default").models["default"].blocks == 10 * 64


async def test_nothing_is_reclaimed_while_events_wait() -> None:
    fleet = churned_fleet()
    streams = Streams(fleet)
    writer = streams.writer("default")
    writer.task.cancel()  # a writer that has not got to its queue yet
    writer.put((1, 0), [Stored(None, [7], [7])])
    debt = fleet.reclaim_debt()
    await daemon.reclaim_when_idle(fleet, streams)
    assert fleet.reclaim_debt() == debt > 0
    await asyncio.gather(writer.task, return_exceptions=True)


async def test_nothing_is_reclaimed_while_routes_come_in() -> None:
    fleet = churned_fleet()
    fleet.route("default", now=time.monotonic(), token_ids=list(range(64)))
    debt = fleet.reclaim_debt()
    await daemon.reclaim_when_idle(fleet, Streams(fleet))
    assert fleet.reclaim_debt() == debt > 0
    fleet.last_route_at -= daemon.ROUTE_QUIET_S
    await daemon.reclaim_when_idle(fleet, Streams(fleet))
    assert fleet.reclaim_debt() == 0
