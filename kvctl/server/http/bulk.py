"""`POST /v1/events` applied a slice of the event loop at a time: a 2,000-event batch into a 10M-pair index took
~80 ms in one step, and every route waited behind it. Decoding and applying now yield to the loop every
`BULK_SLICE_S`, and bulk loads apply one at a time, so two never interleave their events."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from kvctl.core.events import RouterEvent
from kvctl.core.events.dynamo import decode_router_event_json
from kvctl.core.events.errors import DecodeError
from kvctl.server.budget import BULK_SLICE_S
from kvctl.server.state import Fleet

APPLY_EVENTS = 64
"""Events applied between two looks at the clock: far under a slice even for long chains."""


async def decoded(items: Iterable[Any]) -> tuple[list[RouterEvent], Counter[str]]:
    """Every item that decodes as a RouterEvent, and the others counted by kind. Raises what `items` raises
    (a body that is not JSON) before anything is applied."""
    events: list[RouterEvent] = []
    rejected: Counter[str] = Counter()
    end = time.perf_counter() + BULK_SLICE_S
    for item in items:
        try:
            events.append(decode_router_event_json(item))
        except DecodeError as exc:
            rejected[exc.kind.value] += 1
        if time.perf_counter() > end:
            await asyncio.sleep(0)
            end = time.perf_counter() + BULK_SLICE_S
    return events, rejected


class BulkLoads:
    """One bulk load applies at a time (the next waits), each in slices that let routes and engine events in."""

    def __init__(self, fleet: Fleet, clock: Callable[[], float]) -> None:
        self.fleet, self.clock = fleet, clock
        self._one_at_a_time = asyncio.Lock()

    async def apply(self, model: str, events: list[RouterEvent]) -> tuple[int, Counter[str]]:
        """(applied, rejected by kind), as `Fleet.apply` answers for the whole list."""
        applied, rejected = 0, Counter[str]()
        async with self._one_at_a_time:
            end = time.perf_counter() + BULK_SLICE_S
            for start in range(0, len(events), APPLY_EVENTS):
                n, statuses = self.fleet.apply(model, events[start:start + APPLY_EVENTS], self.clock())
                applied += n
                rejected.update(statuses)
                if time.perf_counter() > end:
                    await asyncio.sleep(0)
                    end = time.perf_counter() + BULK_SLICE_S
        return applied, rejected
