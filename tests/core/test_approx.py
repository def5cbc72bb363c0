"""Approximate mode (Dynamo's PruneManager) against hand-worked cases and a dict reference model.

Time is a plain float passed to every call (the fake clock). The reference model is Dynamo's own
definition: a map (worker, sequence hash, position) -> expiry, where a record sets now + ttl, expiry
drops every key with expiry <= now, and a prune drops keys earliest-expiry-first, then largest
(position, hash, worker) first.
"""

from __future__ import annotations

import gc
import math
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvctl.core.hashing import local_block_hashes, sequence_hashes
from kvctl.core.names import WorkerKey
from kvctl.core.router.approx import ApproxConfig, ApproxIndexer, ApproxStats

Key = tuple[WorkerKey, int, int]  # (worker, sequence hash, position)

W1: WorkerKey = (1, 0)
W2: WorkerKey = (2, 0)
EMPTY = ApproxStats(blocks=0, nodes=0, timers=0, heap=0)


def hashes(tokens: list[int], block_size: int = 4) -> tuple[list[int], list[int]]:
    local = local_block_hashes(tokens, block_size)
    return local, sequence_hashes(local)


def record(ix: ApproxIndexer, worker: WorkerKey, local: list[int], now: float) -> int:
    return ix.record(worker, local, sequence_hashes(local), now)


def depth(ix: ApproxIndexer, worker: WorkerKey, local: list[int]) -> int:
    return ix.find_matches(local).scores.get(worker, 0)


# ----- recording and matching --------------------------------------------------------------------------


def test_record_credits_the_worker_with_the_request_depth() -> None:
    ix = ApproxIndexer()
    prompt = list(range(12))  # three blocks of 4
    local, seq = hashes(prompt)
    assert ix.find_matches(local).scores == {}
    assert ix.record(W1, local, seq, now=0.0) == 0
    assert ix.find_matches(local).scores == {W1: 3}
    diverging, _ = hashes(prompt[:8] + [99, 98, 97, 96])
    assert ix.find_matches(diverging).scores == {W1: 2}
    longer, _ = hashes(prompt + [5, 5, 5, 5])
    assert ix.find_matches(longer).scores == {W1: 3}
    assert ix.find_matches(longer).tree_sizes == {W1: 3}
    assert ix.stats() == ApproxStats(blocks=3, nodes=1, timers=3, heap=3)
    assert ix.last_event_id == 1


def test_each_worker_and_dp_rank_is_credited_separately() -> None:
    ix = ApproxIndexer()
    local = [10, 11, 12]
    record(ix, (1, 0), local, 0.0)
    record(ix, (1, 1), local[:2], 0.0)
    assert ix.find_matches(local).scores == {(1, 0): 3, (1, 1): 2}
    assert ix.size() == 5


def test_mismatched_or_empty_requests() -> None:
    ix = ApproxIndexer()
    with pytest.raises(ValueError, match="2 local hashes but 1 sequence hashes"):
        ix.record(W1, [1, 2], [1], 0.0)
    with pytest.raises(ValueError, match="now must be finite"):
        ix.record(W1, [1], [1], math.nan)
    assert ix.record(W1, [], [], 0.0) == 0
    assert ix.stats() == EMPTY
    assert ix.last_event_id == 0
    assert ix.next_expiry() is None
    assert ix.expire(1e9) == 0


# ----- TTL ---------------------------------------------------------------------------------------------


def test_expiry_at_exactly_now_plus_ttl_and_not_before() -> None:
    ix = ApproxIndexer()
    local, seq = hashes(list(range(12)))
    ix.record(W1, local, seq, now=0.0)
    assert ix.next_expiry() == 120.0
    assert ix.expire(math.nextafter(120.0, 0.0)) == 0
    assert depth(ix, W1, local) == 3
    assert ix.expire(120.0) == 3
    assert ix.find_matches(local).scores == {}
    assert ix.next_expiry() is None
    assert ix.stats() == EMPTY
    assert ix.last_event_id == 4  # one Stored, then one single-block Removed per block


def test_stats_count_queued_blocks_live_and_stale() -> None:
    ix = ApproxIndexer()
    record(ix, W1, [1, 2, 3], 0.0)
    record(ix, W1, [1, 2], 10.0)  # 1 and 2 refreshed: their first entries are stale
    record(ix, W2, [4, 5], 10.0)
    assert ix.stats() == ApproxStats(blocks=5, nodes=2, timers=5, heap=7)
    assert ix.expire(120.0) == 1
    assert ix.stats() == ApproxStats(blocks=4, nodes=2, timers=4, heap=4)


def test_ttl_is_configurable() -> None:
    ix = ApproxIndexer(ApproxConfig(ttl_s=2.5))
    record(ix, W1, [1, 2], 10.0)
    assert ix.next_expiry() == 12.5
    assert ix.expire(12.4) == 0
    assert ix.expire(12.5) == 2


def test_re_recording_refreshes_the_expiry() -> None:
    ix = ApproxIndexer()
    local, seq = hashes(list(range(12)))
    ix.record(W1, local, seq, now=0.0)
    ix.record(W1, local, seq, now=100.0)
    assert ix.expire(120.0) == 0  # the stale t=0 entries are skipped
    assert depth(ix, W1, local) == 3
    assert ix.next_expiry() == 220.0
    assert ix.expire(219.0) == 0
    assert ix.expire(220.0) == 3
    assert ix.stats() == EMPTY


def test_refreshing_a_prefix_keeps_only_the_prefix() -> None:
    ix = ApproxIndexer()
    local = [7, 8, 9, 10]
    record(ix, W1, local, 0.0)
    record(ix, W1, local[:2], 100.0)  # a shorter request: only its blocks are refreshed
    assert ix.expire(120.0) == 2
    assert depth(ix, W1, local) == 2
    assert ix.expire(220.0) == 2
    assert ix.stats() == EMPTY


def test_expire_removes_deepest_first_so_shared_prefixes_stay_whole() -> None:
    ix = ApproxIndexer()
    record(ix, W1, [1, 2, 3], 0.0)
    record(ix, W1, [1, 2, 4], 50.0)  # splits the edge; refreshes 1 and 2
    record(ix, W2, [1, 2, 3], 60.0)
    assert ix.expire(120.0) == 1  # W1's block 3 only
    assert ix.find_matches([1, 2, 3]).scores == {W1: 2, W2: 3}
    assert ix.find_matches([1, 2, 4]).scores == {W1: 3, W2: 2}
    assert ix.expire(170.0) == 3
    assert ix.find_matches([1, 2, 3]).scores == {W2: 3}
    assert ix.expire(180.0) == 3
    assert ix.stats() == EMPTY


# ----- reference model ---------------------------------------------------------------------------------

WORKERS = [(1, 0), (1, 1), (2**63 + 5, 0)]
TTL = 100.0

# A small alphabet so requests share prefixes; values across the u64 range.
prompts = st.lists(st.sampled_from([1, 2, 2**64 - 1]), min_size=1, max_size=5)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("record"), st.sampled_from(WORKERS), prompts, st.sampled_from([0.0, 0.0, 1.0, 30.0])),
        st.tuples(st.just("expire"), st.sampled_from([0.0, 1.0, 40.0, 99.0, 100.0, 150.0])),
        st.tuples(st.just("remove_worker"), st.sampled_from(WORKERS)),
    ),
    max_size=40,
)


def entry_order(item: tuple[Key, float]) -> tuple[float, int, int, WorkerKey]:
    """Dynamo's pop order: earliest expiry first, then the largest (position, hash, worker) first."""
    (worker, key, pos), expiry = item
    return (expiry, -pos, -key, (-worker[0], -worker[1]))


def prune_reference(model: dict[Key, float], config: ApproxConfig) -> None:
    if len(model) <= config.max_tree_size:
        return
    for k, _ in sorted(model.items(), key=entry_order)[: len(model) - config.prune_target]:
        del model[k]


def check(ix: ApproxIndexer, model: dict[Key, float], seen: list[list[int]]) -> None:
    assert ix.size() == len(model)
    stats = ix.stats()
    assert stats.timers == len(model)
    assert stats.timers <= stats.heap <= 50 * stats.timers  # every live timer is queued; stale ones are bounded
    assert ix.next_expiry() == (min(model.values()) if model else None)
    for local in seen:
        seq = sequence_hashes(local)
        expected: dict[WorkerKey, int] = {}
        for worker in WORKERS:
            d = 0
            while d < len(seq) and (worker, seq[d], d) in model:
                d += 1
            if d:
                expected[worker] = d
        assert ix.find_matches(local).scores == expected


def run_against_model(config: ApproxConfig, steps: list[tuple]) -> None:
    ix = ApproxIndexer(config)
    model: dict[Key, float] = {}
    seen: list[list[int]] = []
    now = 0.0
    for step in steps:
        if step[0] == "record":
            _, worker, local, dt = step
            now += dt
            seq = sequence_hashes(local)
            for pos, key in enumerate(seq):
                model[(worker, key, pos)] = now + config.ttl_s
            grown = len(model)
            prune_reference(model, config)
            assert ix.record(worker, local, seq, now) == grown - len(model)
            seen.append(local)
        elif step[0] == "expire":
            now += step[1]
            due = [k for k, expiry in model.items() if expiry <= now]
            for k in due:
                del model[k]
            assert ix.expire(now) == len(due)
        else:
            worker = step[1]
            held = [k for k in model if k[0] == worker]
            for k in held:
                del model[k]
            assert ix.remove_worker(*worker) == len(held)
        check(ix, model, seen)
    assert ix.expire(now + config.ttl_s) == len(model)
    assert ix.stats() == EMPTY


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_expire_matches_the_reference_model(steps: list[tuple]) -> None:
    run_against_model(ApproxConfig(ttl_s=TTL), steps)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.integers(1, 12), st.sampled_from([0.1, 0.5, 0.8, 1.0]))
def test_expire_and_prune_match_the_reference_model(steps: list[tuple], max_size: int, ratio: float) -> None:
    run_against_model(ApproxConfig(ttl_s=TTL, max_tree_size=max_size, prune_target_ratio=ratio), steps)


# ----- size cap ----------------------------------------------------------------------------------------


def test_cap_prunes_to_the_target_oldest_expiry_first() -> None:
    ix = ApproxIndexer(ApproxConfig(max_tree_size=50, prune_target_ratio=0.8))
    requests = [[100 * r + i for i in range(6)] for r in range(9)]  # disjoint, 6 blocks each
    for r, local in enumerate(requests[:8]):
        assert record(ix, W1, local, float(r)) == 0
    assert ix.size() == 48
    assert record(ix, W1, requests[8], 8.0) == 14  # 54 > 50: prune to floor(50 × 0.8) = 40
    assert ix.size() == 40 and ix.pruned == 14  # counted: 1.6.1 has no cap, its index would hold them
    depths = [depth(ix, W1, local) for local in requests]
    assert depths == [0, 0, 4, 6, 6, 6, 6, 6, 6]  # the oldest two, then the deepest two of the third
    assert ix.stats().timers == 40
    assert ix.expire(200.0) == 40
    assert ix.stats() == EMPTY


def test_cap_among_equal_expiries_takes_deepest_then_largest_hash_then_largest_worker() -> None:
    ix = ApproxIndexer(ApproxConfig(max_tree_size=10, prune_target_ratio=0.5))
    local = [1, 2, 3, 4]
    record(ix, (1, 0), local, 0.0)
    record(ix, (2, 0), local, 0.0)
    # 12 > 10: 7 go. Position 3 (all three workers), position 2 (all three), then at position 1 the
    # three entries share their hash, so the largest worker goes.
    assert record(ix, (2, 1), local, 0.0) == 7
    assert ix.find_matches(local).scores == {(1, 0): 2, (2, 0): 2, (2, 1): 1}
    assert ix.size() == 5


def test_cap_among_equal_expiry_and_position_takes_the_largest_hash() -> None:
    ix = ApproxIndexer(ApproxConfig(max_tree_size=3, prune_target_ratio=1.0))
    small, large = [5, 6], [9, 6]
    seq_small, seq_large = sequence_hashes(small), sequence_hashes(large)
    ix.record(W1, small, seq_small, 0.0)
    assert ix.record(W1, large, seq_large, 0.0) == 1  # 4 > 3: one goes, the larger position-1 hash
    gone = small if seq_small[1] > seq_large[1] else large
    kept = large if gone is small else small
    assert depth(ix, W1, gone) == 1
    assert depth(ix, W1, kept) == 2


# ----- memory and workers ------------------------------------------------------------------------------


def cycle(ix: ApproxIndexer, salt: int, now: float) -> None:
    for r in range(300):
        local = [salt * 1_000_003 + r * 97 + i for i in range(8)]
        record(ix, (r % 3, r % 2), local, now)
        record(ix, (r % 3, r % 2), local[:4], now + 1.0)  # refreshes: stale heap entries too
    assert ix.size() > 0
    ix.expire(now + 1.0 + ix.config.ttl_s)


def test_everything_expired_leaves_nothing_behind() -> None:
    # Traced from the start: the warm-up cycle lets the index learn its worker keys and grow its
    # per-worker lookup dicts (a Python dict keeps its table when emptied), so a second cycle of as
    # many blocks must free everything it allocates.
    gc.collect()
    tracemalloc.start()
    try:
        ix = ApproxIndexer()
        cycle(ix, 1, 0.0)
        assert ix.stats() == EMPTY
        gc.collect()
        baseline = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        cycle(ix, 2, 1000.0)
        gc.collect()
        after, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ix.stats() == EMPTY
    assert ix.find_matches([2_000_006]).scores == {}
    assert peak - baseline > 500_000  # the cycle did hold thousands of blocks
    assert abs(after - baseline) < 4096


def test_remove_worker_drops_its_timers() -> None:
    ix = ApproxIndexer()
    local = [1, 2, 3]
    record(ix, W1, local, 0.0)
    record(ix, W2, local, 10.0)
    assert ix.remove_worker(1) == 3
    assert ix.stats().timers == 3
    assert ix.find_matches(local).scores == {W2: 3}
    assert ix.next_expiry() == 130.0
    assert ix.expire(125.0) == 0  # W1's timers are gone: no Removed for it
    assert ix.index.workers() == [W2]  # and no event brought it back
    assert ix.find_matches(local).scores == {W2: 3}
    assert ix.expire(130.0) == 3
    assert ix.stats() == EMPTY


def test_remove_one_dp_rank() -> None:
    ix = ApproxIndexer()
    record(ix, (1, 0), [1, 2], 0.0)
    record(ix, (1, 1), [1, 2], 0.0)
    assert ix.remove_worker(1, dp_rank=1) == 2
    assert ix.stats().timers == 2
    assert ix.find_matches([1, 2]).scores == {(1, 0): 2}
    assert ix.remove_worker(1) == 2
    assert ix.stats() == EMPTY  # no live timer: the stale heap entries went too


def test_a_removed_worker_can_come_back() -> None:
    ix = ApproxIndexer()
    record(ix, W1, [1, 2], 0.0)
    ix.remove_worker(1)
    record(ix, W1, [1, 2], 0.0)  # same expiry as the dropped timers
    assert ix.expire(120.0) == 2
    assert ix.stats() == EMPTY


def test_the_heap_is_rebuilt_when_stale_entries_pile_up() -> None:
    ix = ApproxIndexer()
    for t in range(200):  # one timer refreshed 200 times: 199 stale entries
        record(ix, W1, [42], float(t))
        assert ix.stats().heap <= 50 * ix.stats().timers
    assert ix.next_expiry() == 319.0
    assert ix.expire(318.0) == 0
    assert ix.expire(319.0) == 1


# ----- config ------------------------------------------------------------------------------------------


def test_config_defaults_match_dynamo() -> None:
    config = ApproxConfig()
    assert (config.ttl_s, config.max_tree_size, config.prune_target_ratio) == (120.0, 2**20, 0.8)
    assert config.prune_target == 838_860


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"ttl_s": 0.0}, "ttl_s"),
        ({"ttl_s": -1.0}, "ttl_s"),
        ({"ttl_s": math.nan}, "ttl_s"),
        ({"max_tree_size": 0}, "max_tree_size"),
        ({"max_tree_size": 2.5}, "max_tree_size"),
        ({"max_tree_size": True}, "max_tree_size"),
        ({"prune_target_ratio": 0.0}, "prune_target_ratio"),
        ({"prune_target_ratio": 1.5}, "prune_target_ratio"),
        ({"prune_target_ratio": math.nan}, "prune_target_ratio"),
    ],
)
def test_config_validation_names_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ApproxConfig(**kwargs)  # type: ignore[arg-type]
