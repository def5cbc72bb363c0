"""The HTTP API through httpx against the app in-process: every endpoint and its documented errors."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from kvctl.core.events import RouterEvent, Stored
from kvctl.core.events.dynamo import decode_router_event_json, encode_router_event_json
from kvctl.core.hashing import local_block_hashes, sequence_hashes
from kvctl.core.index import KvIndex
from kvctl.server.http.api import create_app
from kvctl.server.route_limits import RouteLimits
from kvctl.server.state import Fleet
from kvctl.server.worker_info import WorkerInfo
from tests.fixtures_path import FIXTURES
from tests.support.eventually import eventually_async
from tests.support.served import served

BIG = 2**63 + 7  # worker ids and hashes beyond 2^53 must survive JSON both ways
TOKENS = list(range(100, 164))  # 4 blocks of 16


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def client(route_path: str):
    fleet = Fleet(block_size=16, seed=0)
    app = create_app(fleet, clock=Clock())
    async with served(app, route_path) as c:
        yield c


def _store_event(worker_id: int, tokens: list[int], dp_rank: int = 0, event_id: int = 1) -> dict:
    local = local_block_hashes(tokens, 16)
    ev = RouterEvent(worker_id, Stored(None, sequence_hashes(local), local), dp_rank, event_id)
    return json.loads(encode_router_event_json(ev))


async def test_health(client: httpx.AsyncClient) -> None:
    r = await client.get("/healthz")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert (await client.get("/openapi.json")).status_code == 200


async def test_workers_register_list_delete(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/workers", json={"worker_id": BIG, "dp_rank": 1, "endpoint": "tcp://127.0.0.1:5557"})
    assert r.status_code == 201
    assert r.json()["worker_id"] == BIG and r.json()["blocks"] == 0 and r.json()["busy"] is False
    rows = (await client.get("/v1/workers")).json()["workers"]
    assert [(w["worker_id"], w["dp_rank"], w["model"]) for w in rows] == [(BIG, 1, "default")]
    assert (await client.post("/v1/workers", json={"worker_id": -1})).status_code == 422
    assert (await client.post("/v1/workers", json={"worker_id": 1, "bogus": 1})).status_code == 422
    r = await client.delete(f"/v1/workers/{BIG}")
    assert r.status_code == 200 and r.json()["removed"] == [{"worker_id": BIG, "dp_rank": 1}]
    assert (await client.delete(f"/v1/workers/{BIG}")).status_code == 404


async def test_events_single_list_jsonl_and_rejections(client: httpx.AsyncClient) -> None:
    one = _store_event(BIG, TOKENS)
    r = await client.post("/v1/events", json=one)
    assert r.json() == {"applied": 1, "rejected": {}}
    two = [_store_event(1, TOKENS), _store_event(2, TOKENS[:32])]
    assert (await client.post("/v1/events", json=two)).json() == {"applied": 2, "rejected": {}}
    orphan = dict(_store_event(3, TOKENS), event={**one["event"], "data": {"stored": {
        "parent_hash": 12345, "blocks": one["event"]["data"]["stored"]["blocks"]}}})
    body = "\n".join([json.dumps(orphan), json.dumps({"worker_id": -1, "event": {}}), json.dumps(one)])
    r = await client.post("/v1/events", content=body, headers={"content-type": "application/x-ndjson"})
    assert r.status_code == 200
    assert r.json()["applied"] == 1 and r.json()["rejected"]["parent_block_not_found"] == 1
    assert sum(r.json()["rejected"].values()) == 2  # plus one decode error, by its kind
    bad = await client.post("/v1/events", content=b"{nope", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and "not JSON" in bad.json()["error"]
    stats = (await client.get("/v1/tree/stats")).json()["models"]["default"]
    # a rejected event still makes its worker known (as Dynamo does), holding nothing
    assert stats["blocks"] == 4 + 4 + 2 and stats["workers"] == {f"{BIG}:0": 4, "1:0": 4, "2:0": 2, "3:0": 0}
    assert await _rejected_by_worker(client) == {BIG: {}, 1: {}, 2: {}, 3: {"parent_block_not_found": 1}}
    await client.post("/v1/reset", json={"worker_id": 3})
    assert (await _rejected_by_worker(client))[3] == {}  # a reset worker starts over


async def test_a_salted_cache_matches_only_a_route_with_its_salt(client: httpx.AsyncClient) -> None:
    """SGLang's cache_salt: a worker's salted blocks hash under the salt (Dynamo's query cache_salt)."""
    salted = local_block_hashes(TOKENS, 16, cache_salt="tenant-42")
    await client.post("/v1/events", json=[_store_event(1, TOKENS), json.loads(encode_router_event_json(
        RouterEvent(2, Stored(None, sequence_hashes(salted), salted), 0, 1)))])

    async def overlaps(**body: object) -> dict[int, int]:
        answer = (await client.post("/v1/route", json={"token_ids": TOKENS, "explain": True, **body})).json()
        return {c["worker_id"]: c["overlap_blocks"] for c in answer["candidates"]}

    assert await overlaps() == {1: 4, 2: 0}
    assert await overlaps(cache_salt="tenant-42") == {1: 0, 2: 4}
    assert await overlaps(cache_salt="") == {1: 4, 2: 0}  # an empty salt is none, as in Dynamo
    refused = await client.post("/v1/route", json={"local_hashes": salted, "cache_salt": "tenant-42"})
    assert refused.status_code == 400 and "hashed already" in refused.json()["error"]


async def _rejected_by_worker(client: httpx.AsyncClient) -> dict[int, dict[str, int]]:
    """Whose events the index refused, not only how many: what `kvctl doctor` needs to name a worker."""
    return {w["worker_id"]: w["rejected_events"] for w in (await client.get("/v1/workers")).json()["workers"]}


async def test_route_explain_and_errors(client: httpx.AsyncClient) -> None:
    assert (await client.post("/v1/route", json={"token_ids": TOKENS})).status_code == 503  # nobody registered
    await client.post("/v1/events", json=[_store_event(1, TOKENS), _store_event(2, TOKENS[:16])])
    await client.post("/v1/workers", json={"worker_id": 3})
    r = await client.post("/v1/route", json={"token_ids": TOKENS, "explain": True})
    assert r.status_code == 200
    body = r.json()
    assert (body["worker_id"], body["overlap_blocks"], body["required_blocks"], body["reason"]) == (
        1, 4, 4, "lowest_logit")
    cands = {c["worker_id"]: c for c in body["candidates"]}
    assert set(cands) == {1, 2, 3}
    assert (cands[1]["logit"], cands[2]["logit"], cands[3]["logit"]) == (4.0, 7.0, 8.0)
    assert cands[2]["overlap_by_tier"] == {"device": 1, "host_pinned": 0, "disk": 0, "external": 0}
    by_hash = await client.post("/v1/route", json={"local_hashes": local_block_hashes(TOKENS, 16)})
    assert by_hash.json()["worker_id"] == 1
    # token_ids null is token_ids absent, as it was when msgspec decoded them
    null_ids = await client.post("/v1/route", json={"token_ids": None, "local_hashes": local_block_hashes(TOKENS, 16)})
    assert (null_ids.status_code, null_ids.json()["worker_id"]) == (200, 1)
    routes = {w["worker_id"]: w["routes"] for w in (await client.get("/v1/workers")).json()["workers"]}
    assert routes == {1: 3, 2: 0, 3: 0}  # each decision counted on the worker it chose
    assert (await client.post("/v1/route", json={})).status_code == 400
    assert (await client.post("/v1/route", json={"token_ids": None})).status_code == 400
    assert (await client.post("/v1/route", json={"token_ids": [1], "local_hashes": [1]})).status_code == 400
    assert (await client.post("/v1/route", json={"token_ids": [-1]})).status_code == 422
    assert (await client.post("/v1/route", json={"token_ids": [2**32]})).status_code == 422
    assert (await client.post("/v1/route", json={"local_hashes": [2**64]})).status_code == 422
    assert (await client.post("/v1/route", json={"token_ids": [1], "tokens": [1]})).status_code == 422
    assert (await client.post("/v1/route", content=b"{")).status_code == 422
    knobs = ("overlap_score_credit", "overlap_score_credit_decay", "prefill_load_scale", "decode_active_request_weight",
             "host_cache_hit_weight", "disk_cache_hit_weight", "router_temperature", "overlap_score_weight",
             "temperature")
    for knob in knobs:  # never infinite or NaN: JSON has neither, 1e400 overflows
        for value, says in ((b"1e400", knob), (b"-1e400", knob), (b"NaN", "malformed"), (b"Infinity", "malformed")):
            bad = await client.post("/v1/route", content=b'{"token_ids": [1], "%s": %s}' % (knob.encode(), value))
            assert bad.status_code == 422 and says in bad.json()["error"], bad.text
    not_utf8 = await client.post("/v1/route", content=b'{"model": "\x80"}')
    assert not_utf8.status_code == 422 and "can't decode byte 0x80" in not_utf8.json()["error"], not_utf8.text
    for knob in knobs:
        negative = await client.post("/v1/route", json={"token_ids": [1], knob: -1})
        assert negative.status_code == 422 and knob in negative.json()["error"], negative.text
    no_bool = await client.post("/v1/route", json={"token_ids": [1], "track_prefill_tokens": "yes"})
    assert no_bool.status_code == 422 and "track_prefill_tokens" in no_bool.json()["error"]
    assert (await client.post("/v1/route", json={"token_ids": TOKENS, "reserve": True})).status_code == 400
    r = await client.post("/v1/route", json={"model": "nope", "token_ids": TOKENS})
    assert r.status_code == 404 and "nope" in r.json()["error"]


async def test_route_knobs_per_request_and_their_explanation(client: httpx.AsyncClient) -> None:
    await client.post("/v1/events", json=[_store_event(1, TOKENS), _store_event(2, TOKENS[:16])])
    body = {"token_ids": TOKENS, "explain": True}
    plain = {c["worker_id"]: c for c in (await client.post("/v1/route", json=body)).json()["candidates"]}
    assert (plain[1]["credit_by_tier"], plain[1]["decay"], plain[1]["credit"]) == (
        {"device": 4.0, "host_pinned": 0.0, "disk": 0.0, "external": 0.0}, 1.0, 4.0)
    # no overlap credit: both pay the whole prompt (4 blocks) and 4 decode blocks; an exact tie
    tied = (await client.post("/v1/route", json={**body, "overlap_score_credit": 0})).json()
    assert tied["reason"] == "tie_random" and {c["logit"] for c in tied["candidates"]} == {8.0}
    assert (await client.post("/v1/route", json={**body, "overlap_score_weight": 0})).json()["reason"] == "tie_random"
    scaled = (await client.post("/v1/route", json={**body, "prefill_load_scale": 3.0})).json()
    assert {c["worker_id"]: c["logit"] for c in scaled["candidates"]} == {1: 4.0, 2: 3 * 3.0 + 4}
    untracked = (await client.post("/v1/route", json={**body, "track_prefill_tokens": False})).json()
    assert {c["worker_id"]: c["logit"] for c in untracked["candidates"]} == {1: 0.0, 2: 3.0}  # max(0, 4 - credit)


async def test_reserve_prefill_free_and_all_busy(client: httpx.AsyncClient) -> None:
    await client.post("/v1/workers", json={"worker_id": 1})
    r = await client.post("/v1/route", json={"token_ids": TOKENS, "request_id": "a", "reserve": True})
    assert r.status_code == 200 and r.json()["request_id"] == "a"
    row = (await client.get("/v1/workers")).json()["workers"][0]
    assert (row["active_decode_blocks"], row["active_prefill_tokens"]) == (4, 64)
    set_ = await client.post("/busy_threshold", json={"model": "default", "active_prefill_tokens_threshold": 10})
    assert set_.status_code == 200 and set_.json()["active_prefill_tokens_threshold"] == 10
    busy = await client.post("/v1/route", json={"token_ids": TOKENS})
    assert busy.status_code == 503
    assert busy.json()["thresholds"]["active_prefill_tokens_threshold"] == 10
    assert "active_prefill_tokens 64 > 10" in busy.json()["tripped"]["1:0"][0]
    assert "None" not in busy.text  # the thresholds not set are named as unset, never as None
    assert (await client.post("/v1/requests/a/prefill_complete")).status_code == 200
    assert (await client.post("/v1/route", json={"token_ids": TOKENS})).status_code == 200
    assert (await client.delete("/v1/requests/a")).status_code == 200
    assert (await client.delete("/v1/requests/a")).status_code == 404
    assert (await client.post("/v1/requests/zz/prefill_complete")).status_code == 404


async def test_busy_threshold_shapes_like_dynamo(client: httpx.AsyncClient) -> None:
    fields = ["model", "active_decode_blocks_threshold", "active_prefill_tokens_threshold",
              "active_prefill_tokens_threshold_frac"]
    got = (await client.get("/busy_threshold")).json()
    assert list(got) == ["thresholds"] and [list(t) for t in got["thresholds"]] == [fields]
    r = await client.post("/busy_threshold", json={"model": "default", "active_decode_blocks_threshold": 0.8})
    assert list(r.json()) == fields and r.json()["active_decode_blocks_threshold"] == 0.8
    merged = await client.post("/busy_threshold", json={"model": "default", "active_prefill_tokens_threshold": 5})
    assert merged.json()["active_decode_blocks_threshold"] == 0.8  # merge, not replace
    assert (await client.post("/busy_threshold", json={"model": "default"})).json() == merged.json()  # get
    too_big = {"model": "default", "active_decode_blocks_threshold": 1.5}
    out_of_range = await client.post("/busy_threshold", json=too_big)
    assert out_of_range.status_code == 400 and "active_decode_blocks_threshold" in out_of_range.json()["error"]
    unknown = await client.post("/busy_threshold", json={"model": "x", "active_decode_blocks_threshold": 0.5})
    assert unknown.status_code == 404
    assert unknown.json()["error"] == "Model 'x' not found. Thresholds can only be set for discovered models."
    assert (await client.post("/busy_threshold", json={"active_decode_blocks_threshold": 0.5})).status_code == 422


@pytest.mark.parametrize("frac", [1e308, 1e6 * 1.000001])
async def test_an_out_of_range_frac_is_refused_and_routing_goes_on(client: httpx.AsyncClient, frac: float) -> None:
    """1e308 was stored, and then route, workers and /metrics all answered 500 (int(inf))."""
    await client.post("/v1/workers", json={"worker_id": 1})
    r = await client.post("/busy_threshold", json={"model": "default", "active_prefill_tokens_threshold_frac": frac})
    assert r.status_code == 400 and "active_prefill_tokens_threshold_frac must be a number in [0.0, 1e+06]" in r.text
    assert (await client.post("/v1/route", json={"token_ids": TOKENS})).status_code == 200
    assert (await client.get("/v1/workers")).status_code == 200
    assert (await client.get("/metrics")).status_code == 200


@pytest.mark.parametrize(("content_type", "body", "status"), [
    (None, b'{"model": "default"}', 415),  # axum's Json extractor: no JSON content type
    ("text/plain", b'{"model": "default"}', 415),
    ("application/json", b"[", 400),  # not JSON
    ("application/json", b"", 400),
    ("application/json", b'{"model": "default", "active_prefill_tokens_threshold": -1}', 422),
    ("application/json", b'{"model": "default", "active_prefill_tokens_threshold": "5"}', 422),  # no coercion
    ("application/json", b'["default"]', 422),
    ("application/json; charset=utf-8", b'{"model": "default", "colour": "red"}', 200),  # unknown fields ignored
    ("application/merge-patch+json", b'{"model": "default", "active_prefill_tokens_threshold": 7}', 200),
    ("application/json", b'{"model": "default", "active_decode_blocks_threshold": -0.1}', 400),
])
async def test_busy_threshold_refuses_bodies_as_dynamo_does(client: httpx.AsyncClient, content_type: str | None,
                                                            body: bytes, status: int) -> None:
    headers = {"content-type": content_type} if content_type else {}
    r = await client.post("/busy_threshold", content=body, headers=headers)
    assert r.status_code == status, r.text


async def test_busy_threshold_unset_is_kvctls_own(client: httpx.AsyncClient) -> None:
    await client.post("/busy_threshold", json={"model": "default", "active_decode_blocks_threshold": 0.8,
                                               "active_prefill_tokens_threshold": 5})
    cleared = await client.delete("/busy_threshold", params={"model": "default",
                                                              "field": "active_decode_blocks_threshold"})
    assert cleared.json()["active_decode_blocks_threshold"] is None
    assert cleared.json()["active_prefill_tokens_threshold"] == 5


async def test_tree_dump_reloads_into_the_same_index_and_reset(client: httpx.AsyncClient) -> None:
    # Real Dynamo events (its own dump of a 4-worker tree) in, kvctl's dump out.
    lines = (FIXTURES / "dynamo-1.6.1" / "dump.jsonl").read_text().splitlines()
    sent = [decode_router_event_json(line) for line in lines]
    r = await client.post("/v1/events", content="\n".join(lines), headers={"content-type": "application/x-ndjson"})
    assert r.json()["applied"] == len(lines)
    dumped = (await client.get("/v1/tree")).json()
    jsonl = (await client.get("/v1/tree", params={"format": "jsonl"})).text.splitlines()
    assert [json.loads(x) for x in jsonl] == dumped
    original, reloaded = KvIndex(), KvIndex()
    original.load(sent)
    reloaded.load(decode_router_event_json(e) for e in dumped)
    for ev in sent:
        query = ev.data.tokens_hashes  # type: ignore[union-attr]
        assert reloaded.find_matches(query).scores == original.find_matches(query).scores
    assert reloaded.stats()[next(iter(reloaded.stats()))].workers == original.stats()[
        next(iter(original.stats()))].workers
    only = (await client.get("/v1/tree", params={"worker": f"{BIG}"})).json()
    assert only and {e["worker_id"] for e in only} == {BIG}
    assert (await client.get("/v1/tree", params={"worker": "x:y"})).status_code == 400
    assert (await client.get("/v1/tree", params={"format": "xml"})).status_code == 422
    r = await client.post("/v1/reset", json={"worker_id": BIG})
    assert r.json()["cleared"][0]["workers"] == [f"{BIG}:0"] and r.json()["cleared"][0]["blocks"] > 0
    after = (await client.get("/v1/tree/stats")).json()["models"]["default"]["workers"]
    assert after[f"{BIG}:0"] == 0 and any(n > 0 for n in after.values())  # only that worker was cleared
    everything = await client.post("/v1/reset", json={})
    assert everything.status_code == 200
    assert (await client.get("/v1/tree/stats")).json()["models"]["default"]["blocks"] == 0


async def test_admin_token_guards_mutations_and_bodies_are_capped(route_path: str) -> None:
    app = create_app(Fleet(), clock=Clock(), admin_token="s3cret", max_body_bytes=1000)
    async with served(app, route_path) as c:
        one = _store_event(1, TOKENS)
        missing = await c.post("/v1/events", json=one)
        assert missing.status_code == 401 and missing.json()["error"].startswith("this endpoint needs the admin token")
        wrong = await c.post("/v1/events", json=one, headers={"authorization": "Bearer wrong"})
        assert wrong.status_code == 401 and wrong.json()["error"] == "the admin token sent is not this router's"
        ok = await c.post("/v1/events", json=one, headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["applied"] == 1
        for method, path in [("POST", "/v1/reset"), ("DELETE", "/v1/workers/1"), ("POST", "/busy_threshold")]:
            assert (await c.request(method, path, json={})).status_code == 401
        assert (await c.post("/v1/route", json={"token_ids": TOKENS})).status_code == 200  # reads stay open
        assert (await c.get("/v1/tree")).status_code == 200
        big = await c.post("/v1/events", content=b"[" + b" " * 2000 + b"]",
                           headers={"authorization": "Bearer s3cret"})
        assert big.status_code == 413

        async def chunks():  # no Content-Length: the cap is enforced while the body arrives
            for _ in range(5):
                yield b" " * 400

        chunked = await c.post("/v1/events", content=chunks(), headers={"authorization": "Bearer s3cret"})
        assert chunked.status_code == 413


async def test_metrics_reflect_the_state(client: httpx.AsyncClient) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    await client.post("/v1/events", json=[_store_event(1, TOKENS), _store_event(2, TOKENS[:16])])
    await client.post("/v1/events", json={**_store_event(3, TOKENS), "event": {
        "event_id": 9, "data": {"removed": {"block_hashes": [1]}}, "dp_rank": 0}})
    await client.post("/v1/route", json={"token_ids": TOKENS, "request_id": "q", "reserve": True})
    text = (await client.get("/metrics")).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[("kvctl_kv_events_applied_total", (("event_type", "stored"), ("model", "default"),
                                                      ("status", "ok")))] == 2
    assert samples[("kvctl_kv_events_applied_total", (("event_type", "removed"), ("model", "default"),
                                                      ("status", "block_not_found")))] == 1
    assert samples[("kvctl_index_blocks", (("model", "default"), ("tier", "device")))] == 5
    assert samples[("kvctl_worker_active_decode_blocks", (("dp_rank", "0"), ("model", "default"),
                                                          ("worker_id", "1")))] == 4
    assert samples[("kvctl_route_duration_seconds_count", (("model", "default"),))] == 1


async def test_events_for_an_unknown_model_get_404_and_make_no_model(client: httpx.AsyncClient) -> None:
    """Any ?model= made a model (20k of them, a 2 MB /metrics): only configuration or a worker makes one."""
    event = _store_event(1, TOKENS)
    r = await client.post("/v1/events", params={"model": "x"}, json=[event])
    assert r.status_code == 404 and "POST /v1/workers" in r.json()["error"] and r.json()["models"] == ["default"]
    assert list((await client.get("/v1/tree/stats")).json()["models"]) == ["default"]
    assert (await client.post("/v1/workers", json={"worker_id": 1, "model": "x"})).status_code == 201
    assert (await client.post("/v1/events", params={"model": "x"}, json=[event])).json()["applied"] == 1


async def test_routes_past_a_limit_get_429_naming_it_and_its_flag(route_path: str) -> None:
    fleet = Fleet(block_size=16, seed=0, limits=RouteLimits(max_request_tokens=64, max_reservations=2,
                                                             max_reserved_tokens=80))
    fleet.register(WorkerInfo(1, 0, "default"))
    async with served(create_app(fleet), route_path) as client:
        async def route(tokens: list[int], request_id: str | None = None) -> httpx.Response:
            return await client.post("/v1/route", json={"token_ids": tokens, "request_id": request_id,
                                                        "reserve": request_id is not None})

        too_long = await route([*TOKENS, 1])
        assert too_long.status_code == 429 and too_long.json()["flag"] == "--max-request-tokens"
        assert "65 prompt tokens, over 64" in too_long.json()["error"]
        assert (await route(TOKENS, "a")).status_code == 200  # 64 tokens reserved
        too_many_tokens = await route(TOKENS[:32], "b")
        assert too_many_tokens.status_code == 429 and too_many_tokens.json()["limit"] == "max_reserved_tokens"
        assert (await route(TOKENS[:16], "c")).status_code == 200  # 80 tokens: at the limit
        too_many = await route(TOKENS[:1], "d")
        assert too_many.status_code == 429 and too_many.json()["flag"] == "--max-reservations"
        assert (await route(TOKENS)).status_code == 200  # no reservation: only the request's own size counts
        assert (await client.delete("/v1/requests/a")).status_code == 200
        assert (await route(TOKENS, "b")).status_code == 200  # room again once one is freed
        limits = (await client.get("/v1/status")).json()["limits"]
        assert limits["refused"] == {"max_request_tokens": 1, "max_reserved_tokens": 1, "max_reservations": 1}
        assert 'kvctl_route_over_limit_total{limit="max_reservations"} 1.0' in (await client.get("/metrics")).text


async def test_a_dump_lets_events_in_while_it_walks_the_index() -> None:
    """The index is walked a slice at a time with the loop let go between: a worker cleared once the dump has
    begun is missing from the rest of it (a dump captured in one step, holding the loop, had all of it)."""
    fleet = Fleet(block_size=16, seed=0)
    for worker in (1, 2):
        for chain in range(2_000):  # 4,000 edges, each its own node: ~10 ms or more to dump, several slices
            fleet.apply("default", [RouterEvent(worker, Stored(None, [worker << 32 | chain], [chain]))], 0.0)
    app = create_app(fleet)
    started, body = asyncio.Event(), bytearray()

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            started.set()
        body.extend(message.get("body", b""))

    async def clear_worker_2() -> None:
        await started.wait()
        fleet.reset("default", 2, None)

    scope = {"type": "http", "method": "GET", "path": "/v1/tree", "raw_path": b"/v1/tree", "query_string": b"",
             "headers": [], "http_version": "1.1", "scheme": "http", "server": ("k", 80), "client": ("c", 1),
             "root_path": ""}
    clearing = asyncio.create_task(clear_worker_2())
    await app(scope, asyncio.Event().wait, send)
    await clearing
    workers = [event["worker_id"] for event in json.loads(body)]
    assert workers.count(1) == 2_000 and 0 < workers.count(2) < 2_000


async def test_routes_are_answered_while_a_slow_client_streams_a_dump_of_a_large_index(route_path: str) -> None:
    """Routes go on, each within a slice or two, while a dump walks an index of 80,000 edges for a client that
    reads it slowly. One worker's edges are asked for, so that the walk is most of the dump's work: captured in
    one pass, it held the loop for half the dump or more (0.3-0.5 s of 0.6-1.2 s on a busy 2-core machine), and
    the route in flight then waited all that time."""
    fleet = Fleet(block_size=16, seed=0)
    for worker in range(1, 33):  # 2,500 one-block edges under the root, each held by the 32 workers
        fleet.apply("default", [RouterEvent(worker, Stored(None, [chain], [chain])) for chain in range(2_500)], 0.0)
    async with served(create_app(fleet), route_path) as client:
        assert (await client.post("/v1/route", json={"token_ids": TOKENS})).status_code == 200  # the path is warm
        dumping, routes = True, []

        async def route_while_dumping() -> None:
            while dumping:
                sent = time.perf_counter()
                assert (await client.post("/v1/route", json={"token_ids": TOKENS})).status_code == 200
                routes.append((sent, time.perf_counter()))

        router = asyncio.create_task(route_while_dumping())
        await eventually_async(lambda: routes, "routes under way")
        started, lines = time.perf_counter(), 0  # from the ask: the walk starts before the headers are read
        async with client.stream("GET", "/v1/tree", params={"format": "jsonl", "worker": "1"}) as answer:
            async for chunk in answer.aiter_raw(4_096):  # a slow reader
                lines += chunk.count(b"\n")
                await asyncio.sleep(0.001)
        done = time.perf_counter()
        dumping = False
        await router
    dump_s = done - started
    waits = [answered - sent for sent, answered in routes if answered > started and sent < done]
    assert lines == 2_500
    assert len(waits) >= 20, f"{len(waits)} routes answered during a {dump_s:.2f} s dump"
    assert max(waits) < dump_s / 4, f"a route waited {max(waits) * 1e3:.0f} ms of a {dump_s:.2f} s dump"
