"""Active sequences: refcounted prompt blocks, prefill load, idempotent free, expiry by the injected clock."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.core.router.sequences import ActiveSequences, Load

W1, W2 = (1, 0), (1, 1)


def test_shared_prompt_blocks_count_once() -> None:
    seqs = ActiveSequences()
    assert seqs.add("a", W1, [10, 11, 12], 48, now=0.0)
    assert seqs.add("b", W1, [10, 11, 13, 14], 16, now=1.0)
    assert seqs.load(W1) == Load(active_blocks=5, active_prefill_tokens=64, requests=2)
    assert seqs.new_prompt_blocks(W1, [10, 11, 12, 99]) == 1
    assert seqs.new_prompt_blocks(W1, [99, 10]) == 2  # only a prefix counts
    assert seqs.new_prompt_blocks(W2, [10, 11]) == 2
    assert seqs.mark_prefill_completed("a") and seqs.mark_prefill_completed("a")
    assert seqs.load(W1).active_prefill_tokens == 16
    assert seqs.free("a")
    assert seqs.load(W1) == Load(active_blocks=4, active_prefill_tokens=16, requests=1)


def test_unknown_and_duplicate_ids_are_reported_not_raised() -> None:
    seqs = ActiveSequences()
    assert not seqs.free("nope") and not seqs.mark_prefill_completed("nope")
    assert seqs.add("a", W1, [1], 16, now=0.0)
    assert not seqs.add("a", W2, [2], 16, now=0.0)
    assert seqs.load(W2) == Load() and seqs.load(W1).requests == 1
    assert seqs.free("a") and not seqs.free("a")


def test_expiry_frees_exactly_the_stale() -> None:
    seqs = ActiveSequences(expiry_s=300.0)
    seqs.add("old", W1, [1, 2], 32, now=0.0)
    seqs.add("edge", W1, [1, 3], 32, now=100.0)
    seqs.add("new", W2, [4], 16, now=250.0)
    assert seqs.expire(399.9) == ["old"]
    assert seqs.expire(400.0) == ["edge"]
    assert seqs.load(W1) == Load() and seqs.load(W2).requests == 1


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        ActiveSequences(expiry_s=0)
    with pytest.raises(ValueError):
        ActiveSequences().add("a", W1, [], -1, now=0.0)


def test_a_peers_bookings_are_its_own_and_counted_apart() -> None:
    """Replica sync: a peer's request is keyed by (its router id, its id), so its free reaches its booking only,
    whatever id it names; both add to the worker's load, but only this router's own count as its own."""
    seqs = ActiveSequences()
    assert seqs.add("a", W1, [1, 2], 32, now=0.0)
    assert seqs.add("a", W1, [1, 3, 4], 48, now=0.0, owner=7)  # the same id, another router's
    assert not seqs.add("a", W1, [9], 16, now=0.0, owner=7)
    assert (len(seqs), seqs.blocks, seqs.peer_requests, seqs.peer_blocks) == (1, 2, 1, 3)
    assert seqs.load(W1) == Load(active_blocks=4, active_prefill_tokens=80, requests=2)
    assert not seqs.free("a", owner=8) and not seqs.mark_prefill_completed("a", owner=8)
    assert seqs.mark_prefill_completed("a", owner=7) and seqs.get("a").prefill_done is False
    assert seqs.free("a", owner=7) and seqs.get("a") is not None and seqs.get("a", owner=7) is None
    assert (len(seqs), seqs.blocks, seqs.peer_requests, seqs.peer_blocks) == (1, 2, 0, 0)
    assert seqs.add("b", W2, [5], 16, now=0.0, owner=7)
    assert sorted(seqs.remove_worker(1)) == ["a", "b"]
    assert len(seqs) == 0 and seqs.peer_requests == 0 and seqs.loads() == {}


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "prefill", "free", "expire"]),
        st.tuples(st.sampled_from([None, 7, 8]), st.integers(0, 7)),  # (owner: this router or a peer, request id)
        st.sampled_from([W1, W2, (2, 0)]),
        st.lists(st.integers(0, 5), max_size=6),  # prompt block hashes (small alphabet: shared)
        st.integers(0, 500),  # prefill tokens
        st.floats(0, 50),  # clock step
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_loads_match_a_reference_and_never_go_negative(steps) -> None:
    seqs = ActiveSequences(expiry_s=100.0)
    live: dict[tuple, tuple] = {}  # (owner, id) -> (worker, hashes, prefill, added, prefill_done)
    now = 0.0
    for op, (owner, rid_n), worker, hashes, tokens, dt in steps:
        rid, key = f"r{rid_n}", (owner, f"r{rid_n}")
        now += dt
        if op == "add":
            assert seqs.add(rid, worker, hashes, tokens, now, owner=owner) == (key not in live)
            live.setdefault(key, (worker, hashes, tokens, now, False))
        elif op == "prefill":
            assert seqs.mark_prefill_completed(rid, owner) == (key in live)
            if key in live:
                live[key] = (*live[key][:4], True)
        elif op == "free":
            assert seqs.free(rid, owner) == (key in live)
            live.pop(key, None)
        else:
            expected = [k for k, v in live.items() if v[3] <= now - 100.0]
            assert sorted(seqs.expire(now)) == sorted(k[1] for k in expected)
            for k in expected:
                del live[k]
        for w in (W1, W2, (2, 0)):
            mine = [v for v in live.values() if v[0] == w]
            load = seqs.load(w)
            assert load.active_blocks == len({h for v in mine for h in v[1]}) >= 0
            assert load.active_prefill_tokens == sum(v[2] for v in mine if not v[4]) >= 0
            assert load.requests == len(mine)
        assert len(seqs) == sum(k[0] is None for k in live) and seqs.peer_requests == len(live) - len(seqs)
        assert seqs.blocks == sum(len(v[1]) for k, v in live.items() if k[0] is None)
        assert seqs.peer_blocks == sum(len(v[1]) for k, v in live.items() if k[0] is not None)
        for n in range(8):
            assert sorted(seqs.peer_owners(f"r{n}")) == [o for o, r in sorted(live, key=str) if r == f"r{n}" and o]
    for owner, rid in list(live):
        assert seqs.free(rid, owner)
    assert len(seqs) == 0 and seqs.peer_requests == 0 and seqs.loads() == {}
