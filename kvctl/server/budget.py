"""How long one task may hold the event loop before it lets the others run.

Engines publish in bursts; a source or writer that worked through a whole burst in one go would hold
`/v1/route` (and every other request) for as long as the burst lasts. Work loops check the clock and
yield once their slice is spent: a route waits at most about a slice behind ingest.
"""

from __future__ import annotations

import asyncio
import time

SLICE_S = 0.002

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
