"""KvIndex replays what Dynamo 1.6.1's own RadixTree was fed and must answer exactly as it did.

Everything expected here was produced by `dynamo._core.RadixTree` (fixtures/dynamo-1.6.1, see its
README): the events, the query scores, the error behaviour and the tree dump.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvctl.core.events import (
    DecodeError,
    RouterEvent,
    Stored,
    Tier,
    decode_kv_cache_event,
    decode_router_event_json,
    encode_router_event_json,
)
from kvctl.core.index import KvIndex, Status
from tests.fixtures_path import FIXTURES

DYNAMO = FIXTURES / "dynamo-1.6.1"
EVENTS = [json.loads(line) for line in (DYNAMO / "events_applied.jsonl").read_text().splitlines() if line.strip()]
QUERIES = json.loads((DYNAMO / "queries.json").read_text())["queries"]
ERRORS = json.loads((DYNAMO / "errors.json").read_text())["apply_event_errors"]
DUMP_LINES = [line for line in (DYNAMO / "dump.jsonl").read_text().splitlines() if line.strip()]

W1, W2, W3, W4 = 1, 2, 2**63 + 7, 4
# Blocks each worker key holds after events_applied.jsonl, from its notes: w1 P + C1[0]; w2 dp1 P + C2;
# w3 P[:2] + D; w2 dp0 D[0]; w4 cleared.
SIZES_AFTER = {(W1, 0): 5, (W2, 1): 7, (W3, 0): 5, (W2, 0): 1}


def scores_of(expected: dict[str, int]) -> dict[tuple[int, int], int]:
    """The fixture's `"worker:dp" -> depth` as kvctl's `(worker_id, dp_rank) -> depth`."""
    out = {}
    for key, depth in expected.items():
        worker_id, dp_rank = key.split(":")
        out[(int(worker_id), int(dp_rank))] = depth
    return out


def applied_index() -> KvIndex:
    index = KvIndex()
    for line in EVENTS:
        result = index.apply(decode_kv_cache_event(line["event_json"], line["worker_id"]))
        assert result.status is Status.ok, line["note"]
    return index


def assert_reproduces_queries(index: KvIndex) -> None:
    for query in QUERIES:
        assert index.find_matches(query["local_hashes"]).scores == scores_of(query["scores"]), query["description"]


def dump_key(ev: RouterEvent) -> tuple[Any, ...]:
    data = ev.data
    assert isinstance(data, Stored)
    return (ev.worker_id, ev.dp_rank, data.tier, data.parent_hash is not None, data.parent_hash or 0,
            tuple(data.block_hashes), tuple(data.tokens_hashes))


def test_fixture_is_what_the_tests_assume() -> None:
    assert len(EVENTS) == 12
    assert len(QUERIES) == 13
    assert any(q["scores"] == {} for q in QUERIES)
    assert {int(k.split(":")[0]) for q in QUERIES for k in q["scores"]} == {W1, W2, W3}


def test_decoded_events() -> None:
    first = decode_kv_cache_event(EVENTS[0]["event_json"], W1)
    assert first.worker == (W1, 0)
    assert isinstance(first.data, Stored)
    assert first.data.parent_hash is None
    assert first.data.tier is Tier.device
    assert first.data.block_hashes[0] == 17172768840257223234
    assert first.data.tokens_hashes[1] == 7399559639189594755
    assert decode_kv_cache_event(EVENTS[2]["event_json"], W2).worker == (W2, 1)
    assert decode_kv_cache_event(EVENTS[4]["event_json"], W3).worker == (W3, 0)


@pytest.mark.parametrize("query", QUERIES, ids=lambda q: q["description"])
def test_every_query_scores_as_dynamo(query: dict[str, Any]) -> None:
    index = applied_index()
    got = index.find_matches(query["local_hashes"])
    want = scores_of(query["scores"])
    assert got.scores == want
    assert got.tree_sizes == {w: SIZES_AFTER[w] for w in want}
    assert got.by_tier == {}  # one tier only


def test_sizes_after_the_fixture_events() -> None:
    stats = applied_index().stats()
    assert list(stats) == [Tier.device]
    device = stats[Tier.device]
    assert device.blocks == sum(SIZES_AFTER.values()) == 18
    assert {w: n for w, n in device.workers.items() if n} == SIZES_AFTER
    # P (w3 holds a prefix of its edge, no split), C1 (w1 holds a prefix), C2, D; E was cleared and freed.
    assert device.nodes == 4


def test_events_step_by_step() -> None:
    """Scores after the notable steps, derived from each line's note (P is 4 blocks, C1 2 under P)."""
    p = json.loads(EVENTS[0]["event_json"])["data"]["stored"]["blocks"]
    c1 = json.loads(EVENTS[1]["event_json"])["data"]["stored"]["blocks"]
    query = [b["tokens_hash"] for b in p + c1]
    index = KvIndex()
    after: list[dict[tuple[int, int], int]] = []
    for line in EVENTS:
        assert index.apply(decode_kv_cache_event(line["event_json"], line["worker_id"])).status is Status.ok
        after.append(index.find_matches(query).scores)
    assert after[1] == {(W1, 0): 6}
    assert after[8][(W1, 0)] == 5  # C1's last block evicted
    assert after[10][(W1, 0)] == 6  # re-stored under C1[0]
    assert after[11][(W1, 0)] == 5  # evicted again
    e = json.loads(EVENTS[7]["event_json"])["data"]["stored"]["blocks"]
    e_query = [b["tokens_hash"] for b in e]
    assert index.find_matches(e_query).scores == {}


STATUS_OF_ERROR = {
    "Failed to apply event: Failed to find parent block": Status.parent_block_not_found,
    "Failed to apply event: Failed to find block": Status.block_not_found,
}


@pytest.mark.parametrize("case", ERRORS, ids=lambda c: c["note"])
def test_apply_event_errors(case: dict[str, Any]) -> None:
    index = KvIndex()
    assert index.apply(decode_kv_cache_event(EVENTS[0]["event_json"], W1)).status is Status.ok
    p = [b["tokens_hash"] for b in json.loads(EVENTS[0]["event_json"])["data"]["stored"]["blocks"]]
    if case["error_type"] == "ValueError":
        with pytest.raises(DecodeError):
            decode_kv_cache_event(case["event_json"], case["worker_id"])
    else:
        result = index.apply(decode_kv_cache_event(case["event_json"], case["worker_id"]))
        if case["accepted"]:
            assert case["error_type"] is None
            assert result.status is Status.ok
        else:
            assert case["error_type"] == "RuntimeError"
            assert result.status is STATUS_OF_ERROR[case["error"]]
    assert index.find_matches(p).scores == scores_of(case["scores_for_P_after"])


def test_error_cases_cover_every_outcome() -> None:
    kinds = {(c["accepted"], c["error_type"]) for c in ERRORS}
    assert kinds == {(False, "RuntimeError"), (False, "ValueError"), (True, None)}
    assert {c["error"] for c in ERRORS if c["error_type"] == "RuntimeError"} == set(STATUS_OF_ERROR)


def test_stored_without_parent_hash_key_is_stored_at_the_root() -> None:
    (case,) = [c for c in ERRORS if c["accepted"]]
    index = KvIndex()
    event = decode_kv_cache_event(case["event_json"], case["worker_id"])
    assert event.data == Stored(None, [1], [2])
    assert index.apply(event).status is Status.ok
    assert index.find_matches([2]).scores == {(1, 0): 1}


@pytest.mark.parametrize("whole_line", [False, True], ids=["inner_event", "router_event"])
def test_loading_dynamos_dump_reproduces_its_scores(whole_line: bool) -> None:
    index = KvIndex()
    for text in DUMP_LINES:
        line = json.loads(text)
        ev = decode_router_event_json(text) if whole_line else decode_kv_cache_event(line["event"], line["worker_id"])
        assert ev.worker == (line["worker_id"], line["event"]["dp_rank"])
        assert index.apply(ev).status is Status.ok
    assert_reproduces_queries(index)
    assert {w: n for w, n in index.stats()[Tier.device].workers.items() if n} == SIZES_AFTER


def test_kvctl_dump_loads_back_to_the_same_scores() -> None:
    original = applied_index()
    events = original.dump()
    fresh = KvIndex()
    assert [r.status for r in fresh.load(events)] == [Status.ok] * len(events)
    assert_reproduces_queries(fresh)
    assert {w: n for w, n in fresh.stats()[Tier.device].workers.items() if n} == SIZES_AFTER


def test_kvctl_dump_through_dynamo_json_loads_back() -> None:
    lines = [encode_router_event_json(ev) for ev in applied_index().dump()]
    fresh = KvIndex()
    for text in lines:
        assert fresh.apply(decode_router_event_json(text)).status is Status.ok
    assert_reproduces_queries(fresh)


def test_kvctl_dump_has_dynamos_edges() -> None:
    """One Stored per (edge, worker), as Dynamo dumps it (the order is not part of the contract)."""
    mine = sorted(map(dump_key, applied_index().dump()))
    theirs = sorted(dump_key(decode_router_event_json(text)) for text in DUMP_LINES)
    assert len(theirs) == 7
    assert mine == theirs
