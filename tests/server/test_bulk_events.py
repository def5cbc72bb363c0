"""A bulk `POST /v1/events` lets routes through while it applies: it decodes and applies a slice of the loop at a
time, so a route waits for one slice, not for the whole load (issue 27: 80 ms a 2,000-event batch at 10M pairs)."""

from __future__ import annotations

import asyncio
import random

from kvctl.core.events import RouterEvent, Stored
from kvctl.core.events.dynamo import encode_router_event_json
from kvctl.server.http.api import create_app
from kvctl.server.state import Fleet
from tests.support.served import served

EVENTS = 30_000


def _bulk_body() -> bytes:
    rng = random.Random(27)
    events = [RouterEvent(worker_id=2, event_id=i, data=Stored(
        parent_hash=None, block_hashes=[rng.getrandbits(63) for _ in range(4)],
        tokens_hashes=[rng.getrandbits(63) for _ in range(4)])) for i in range(EVENTS)]
    return b"\n".join(encode_router_event_json(event) for event in events)


async def test_routes_are_answered_while_a_bulk_load_applies(route_path: str) -> None:
    body = _bulk_body()
    async with served(create_app(Fleet(block_size=16)), route_path) as client:
        (await client.post("/v1/workers", json={"worker_id": 1})).raise_for_status()
        done_at: list[float] = []

        async def route_until(load: asyncio.Task[object]) -> None:
            while not load.done():
                (await client.post("/v1/route", json={"token_ids": list(range(64))})).raise_for_status()
                done_at.append(asyncio.get_running_loop().time())

        load = asyncio.create_task(client.post("/v1/events", content=body,
                                               headers={"content-type": "application/x-ndjson"}))
        await route_until(load)
        answer = (await load).json()  # type: ignore[attr-defined]
    assert answer == {"applied": EVENTS, "rejected": {}}
    # Counted, not timed (a busy machine stretches any slice): held in one step, the load lets one route through
    # at most; in slices, a route between each. How long a route waits is benchmarks/scale_bench.py's.
    assert len(done_at) >= 20, f"{len(done_at)} routes answered during the load"
