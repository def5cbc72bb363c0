"""Every answer of the router is the encoding of its `kvctl.http_api` Struct: decoded into it and encoded again,
it gives the same bytes (no field the Struct lacks, none missing, same JSON types), so the Structs the clients
decode with are the API itself."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import msgspec
import pytest

from kvctl import http_api as api
from kvctl.core.router.approx import ApproxConfig
from kvctl.core.router.approx_lru import CachePolicy
from kvctl.core.router.busy import Thresholds
from kvctl.server.http.api import create_app
from kvctl.server.state import Fleet

BIG = 2**63 + 7
TOKENS = list(range(100, 164))


@pytest.fixture(params=["exact", "approximate", "lru"])
async def client(request: pytest.FixtureRequest) -> AsyncIterator[httpx.AsyncClient]:
    approx = None if request.param == "exact" else ApproxConfig(policy=CachePolicy(request.param.replace(
        "approximate", "ttl")))
    app = create_app(Fleet(block_size=16, seed=0, approx=approx))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvctl") as c:
        yield c


def exactly(response: httpx.Response, status: int, kind: type[msgspec.Struct]) -> msgspec.Struct:
    assert response.status_code == status, response.text
    decoded = msgspec.json.decode(response.content, type=kind)
    assert msgspec.json.encode(decoded) == response.content, (kind.__name__, response.text)
    return decoded


async def test_every_answer_is_its_struct(client: httpx.AsyncClient) -> None:
    exactly(await client.get("/healthz"), 200, api.Health)
    exactly(await client.post("/v1/workers", json={"worker_id": BIG, "dp_rank": 1, "model": "m"}), 201, api.Worker)
    exactly(await client.post("/v1/workers", json={"worker_id": 2, "model": "m"}), 201, api.Worker)
    exactly(await client.get("/v1/workers"), 200, api.Workers)
    decision = exactly(await client.post("/v1/route", json={"token_ids": TOKENS, "model": "m", "explain": True,
                                                             "request_id": "r1", "reserve": True}), 200, api.Decision)
    assert isinstance(decision, api.Decision) and len(decision.candidates or []) == 2
    exactly(await client.post("/v1/requests/r1/prefill_complete?model=m", json={"cached_tokens": 16}), 200,
            api.PrefillCompleted)
    exactly(await client.delete("/v1/requests/r1?model=m"), 200, api.Freed)
    stats = exactly(await client.get("/v1/tree/stats"), 200, api.TreeStats)
    assert isinstance(stats, api.TreeStats) and set(stats.models) == {"default", "m"}
    exactly(await client.get("/v1/status"), 200, api.Status)
    exactly(await client.post("/v1/reset", json={"model": "m"}), 200, api.Cleared)
    exactly(await client.post("/busy_threshold", json={"model": "m", "active_decode_blocks_threshold": 0.5}), 200,
            api.Thresholds)
    exactly(await client.get("/busy_threshold"), 200, api.ThresholdsList)
    exactly(await client.delete("/busy_threshold", params={"model": "m"}), 200, api.Thresholds)
    exactly(await client.delete(f"/v1/workers/{BIG}"), 200, api.Removed)


async def test_every_error_is_an_error_struct(client: httpx.AsyncClient) -> None:
    unknown = exactly(await client.get("/v1/tree/stats", params={"model": "nope"}), 404, api.Error)
    assert isinstance(unknown, api.Error) and unknown.models == ["default"]
    exactly(await client.post("/v1/route", json={"token_ids": TOKENS}), 503, api.Error)
    exactly(await client.post("/v1/workers", json={"worker_id": -1}), 422, api.Invalid)
    exactly(await client.post("/busy_threshold", json={"model": "default", "active_decode_blocks_threshold": 2}),
            400, api.Error)
    for method, path, status in (("GET", "/nope", 404), ("PUT", "/v1/workers", 405)):
        wrong = exactly(await client.request(method, path), status, api.Error)
        assert isinstance(wrong, api.Error) and f"{method} {path}" in wrong.error and "/openapi.json" in wrong.error


async def test_a_busy_refusal_carries_the_thresholds_and_what_tripped() -> None:
    fleet = Fleet(block_size=16, seed=0, thresholds=Thresholds(active_prefill_tokens_threshold=0))
    app = create_app(fleet)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvctl") as client:
        assert (await client.post("/v1/workers", json={"worker_id": BIG})).status_code == 201
        route = {"token_ids": TOKENS, "request_id": "r1", "reserve": True}
        assert (await client.post("/v1/route", json=route)).status_code == 200
        busy = exactly(await client.post("/v1/route", json={"token_ids": TOKENS}), 503, api.Error)
    assert isinstance(busy, api.Error) and isinstance(busy.thresholds, api.Thresholds)
    assert busy.thresholds.active_prefill_tokens_threshold == 0 and list(busy.tripped or {}) == [f"{BIG}:0"]


@pytest.mark.parametrize("body", [{"worker_id": "1"}, {"worker_id": 1, "dp_rank": "0"}, {"worker_id": 1.5}])
async def test_a_number_sent_as_a_string_is_refused_naming_the_field(client: httpx.AsyncClient, body: dict) -> None:
    invalid = exactly(await client.post("/v1/workers", json=body), 422, api.Invalid)
    assert isinstance(invalid, api.Invalid)
    [field] = invalid.detail
    assert field.loc == ["body", next(k for k, v in body.items() if not isinstance(v, int))] and "int" in field.msg


async def test_tree_stats_say_what_approximate_lru_retains() -> None:
    """A rank of 2 blocks booked a 4-block prompt: all 4 held (in use), 2 past its capacity."""
    app = create_app(Fleet(block_size=16, seed=0, approx=ApproxConfig(policy=CachePolicy.lru)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvctl") as c:
        await c.post("/v1/workers", json={"worker_id": 1, "total_blocks": 2})
        await c.post("/v1/route", json={"token_ids": TOKENS, "request_id": "r", "reserve": True})
        stats = exactly(await c.get("/v1/tree/stats"), 200, api.TreeStats)
    approximate = stats.models["default"].approximate  # type: ignore[attr-defined]
    assert approximate.policy == "lru" and approximate.lru == api.LruRetention(1, 0, 4, 2)


async def test_freeing_in_the_wrong_model_names_the_model_that_has_it() -> None:
    """A plane's workers are in their cards' model (`tiny`): a free that names none looked in `default` and said
    only "not in flight (already freed?)", which reads as a lost request."""
    fleet = Fleet(block_size=16, seed=0)
    app = create_app(fleet)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvctl") as c:
        await c.post("/v1/workers", json={"worker_id": 1, "model": "tiny"})
        await c.post("/v1/route", json={"model": "tiny", "token_ids": TOKENS, "request_id": "r", "reserve": True})
        wrong = await c.delete("/v1/requests/r")
        gone = await c.delete("/v1/requests/r", params={"model": "tiny"})
        again = await c.post("/v1/requests/r/prefill_complete", params={"model": "tiny"})
    assert wrong.status_code == 404 and wrong.json()["error"] == (
        "request 'r' is not in flight in model 'default': it is in flight in model 'tiny' (pass ?model=tiny)")
    assert gone.status_code == 200
    assert again.json()["error"] == "request 'r' is not in flight in model 'tiny' (already freed?)"
