"""The counters the monitoring pack (contrib/monitoring) needs from the router: the engine-observed hit rate
joined per worker with the router's prediction, refusals with every worker busy, routes per worker, and the
approximate-mode cap."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvctl.core.router.approx import ApproxConfig
from kvctl.server.http.api import create_app
from kvctl.server.state import Fleet
from tests.server.test_api import TOKENS, _store_event
from tests.support.served import served

WORKER = (("dp_rank", "0"), ("model", "default"), ("worker_id", "1"))


async def samples(client: httpx.AsyncClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = (await client.get("/metrics")).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture
async def client(route_path: str) -> AsyncIterator[httpx.AsyncClient]:
    """The router's app served on each route path: both must count the same."""
    async with served(create_app(Fleet(block_size=16, seed=0)), route_path) as c:
        await c.post("/v1/workers", json={"worker_id": 1})
        yield c


async def test_prefill_complete_joins_what_the_engine_found_with_what_the_router_predicted(
        client: httpx.AsyncClient) -> None:
    await client.post("/v1/events", json=[_store_event(1, TOKENS[:48])])  # 3 of the prompt's 4 blocks held
    for request_id, cached in (("a", 32), ("b", None), ("c", 1000)):
        assert (await client.post("/v1/route", json={"token_ids": TOKENS, "request_id": request_id,
                                                     "reserve": True})).json()["overlap_blocks"] == 3
        body = None if cached is None else {"cached_tokens": cached}
        assert (await client.post(f"/v1/requests/{request_id}/prefill_complete", json=body)).status_code == 200
    got = await samples(client)
    # "b" reported nothing, so it is not joined; "c" reported more than its prompt: capped at its 4 blocks.
    assert got["kvctl_worker_joined_requests_total", WORKER] == 2
    assert got["kvctl_worker_joined_prompt_blocks_total", WORKER] == 8
    assert got["kvctl_worker_predicted_cached_blocks_total", WORKER] == 6
    assert got["kvctl_worker_observed_cached_blocks_total", WORKER] == 2 + 4
    assert got["kvctl_worker_routes_total", WORKER] == 3


async def test_a_bad_cached_tokens_body_gets_422_naming_the_field(client: httpx.AsyncClient) -> None:
    await client.post("/v1/route", json={"token_ids": TOKENS, "request_id": "a", "reserve": True})
    for body in ({"cached_tokens": -1}, {"cached": 3}):
        answer = await client.post("/v1/requests/a/prefill_complete", json=body)
        assert answer.status_code == 422 and "cached" in answer.text
    assert (await client.post("/v1/requests/a/prefill_complete", json={"cached_tokens": 0})).status_code == 200


async def test_routes_refused_with_every_worker_busy_are_counted_by_model(client: httpx.AsyncClient) -> None:
    assert (await samples(client))["kvctl_route_all_busy_total", (("model", "default"),)] == 0
    await client.post("/v1/route", json={"token_ids": TOKENS, "request_id": "a", "reserve": True})
    await client.post("/busy_threshold", json={"model": "default", "active_prefill_tokens_threshold": 10})
    for _ in range(2):
        assert (await client.post("/v1/route", json={"token_ids": TOKENS})).status_code == 503
    assert (await samples(client))["kvctl_route_all_busy_total", (("model", "default"),)] == 2


async def test_the_approximate_mode_cap_is_exported_only_in_approximate_mode(client: httpx.AsyncClient) -> None:
    assert not any(name == "kvctl_index_cap_blocks" for name, _ in await samples(client))
    app = create_app(Fleet(block_size=16, approx=ApproxConfig(max_tree_size=4000)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvctl") as approx:
        exported = await samples(approx)
        assert exported["kvctl_index_cap_blocks", (("model", "default"),)] == 4000
        assert exported["kvctl_index_pruned_blocks_total", (("model", "default"),)] == 0


async def test_the_router_process_memory_is_exported(client: httpx.AsyncClient) -> None:
    """The dashboard's memory panel: the index lives in the router's own memory."""
    assert (await samples(client))["process_resident_memory_bytes", ()] > 10 * 2**20
