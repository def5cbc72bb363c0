"""How long one task may hold the event loop before it lets the others run.

Engines publish in bursts; a source or writer that worked through a whole burst in one go would hold
`/v1/route` (and every other request) for as long as the burst lasts. Work loops check the clock and
yield once their slice is spent: a route waits at most about a slice behind ingest.
"""

from __future__ import annotations

import asyncio
import time

SLICE_S = 0.002

BULK_SLICE_S = 0.0005
"""The slice of a bulk load (`POST /v1/events`), which holds the loop for as long as its client keeps sending: a
route takes a loop turn or two (its head and body may arrive apart), each behind a slice, so at 2 ms slices its
p99 was 6-10 ms during one (issue 40's target: 5 ms). At 0.5 ms: 1.8-3.6 ms, for ~10 % more time per batch
(benchmarks/scale_bench.py's bulk row)."""

RECLAIM_ENTRIES = 2048
"""Freed index lookup entries given back per slice of the loop (`RadixTree.reclaim`): about 0.4 ms."""


class Slices:
    """A loop over messages that lets the event loop run once a slice is spent: a socket or subscription with a
    backlog hands its messages over without ever waiting, so a flood would otherwise hold the loop to its end
    (100,000 messages of new publisher ids on the ZMQ plane held it 8.6 s)."""

    def __init__(self) -> None:
        self._end = 0.0

    async def tick(self) -> None:
        if time.perf_counter() > self._end:
            await asyncio.sleep(0)
            self._end = time.perf_counter() + SLICE_S
