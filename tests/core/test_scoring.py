"""The cost function, its tie-breaks and its sampling, with logits computed by hand."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.core.events import RouterEvent, Stored, Tier
from kvctl.core.hashing import local_block_hashes, sequence_hashes
from kvctl.core.index import IndexMatches
from kvctl.core.router.router import Router
from kvctl.core.router.scoring import (
    DEFAULT_TIER_CREDITS,
    NoCandidates,
    Reason,
    RouterConfig,
    effective_overlap,
    score,
    select,
)
from kvctl.core.router.sequences import Load

A, B, C = (1, 0), (2, 0), (3, 1)
DEFAULT = RouterConfig()


def _rows(scores, tree_sizes, loads, new_blocks, *, isl=64, bs=16, config=DEFAULT, by_tier=None):
    matches = IndexMatches(scores=scores, tree_sizes=tree_sizes, by_tier=by_tier or {})
    return score([A, B, C], matches, loads, new_blocks.__getitem__, isl_tokens=isl, block_size=bs, config=config)


def _pick(scores, temperature, rng):
    i, reason = select(scores, temperature, rng)
    return scores.workers[i], reason


def test_logits_by_hand() -> None:
    # ISL 64 tokens = 4 blocks of 16.
    # A: 3 cached, 32 prefill tokens in flight, 5 active blocks, 1 new  -> p=(32+16)/16=3,  d=6, logit 9
    # B: 0 cached, idle, 4 new                                           -> p=64/16=4,      d=4, logit 8
    # C: 4 cached, 100 prefill tokens, 10 active blocks, 0 new           -> p=100/16=6.25,  d=10, logit 16.25
    rows = _rows({A: 3, C: 4}, {A: 30, C: 7},
                 {A: Load(5, 32, 2), C: Load(10, 100, 3)}, {A: 1, B: 4, C: 0})
    assert [(r.prefill_blocks, r.decode_blocks, r.logit) for r in rows.rows()] == [(3.0, 6, 9.0), (4.0, 4, 8.0),
                                                                             (6.25, 10, 16.25)]
    assert rows.tree_size == [30, 0, 7]
    chosen, reason = _pick(rows, 0.0, random.Random(0))
    assert chosen == B and reason is Reason.lowest_logit


def test_overlap_weight_override_changes_the_winner() -> None:
    loads, new = {A: Load(5, 32, 2), C: Load(10, 100, 3)}, {A: 1, B: 4, C: 0}
    # weight 2: A = 2*3+6 = 12, B = 2*4+4 = 12, C = 2*6.25+10 = 22.5 -> tie A/B, B has tree size 0
    rows = _rows({A: 3, C: 4}, {A: 30, C: 7}, loads, new, config=RouterConfig().override(overlap_score_weight=2))
    assert rows.logit == [12.0, 12.0, 22.5]
    chosen, reason = _pick(rows, 0.0, random.Random(0))
    assert chosen == B and reason is Reason.tie_smallest_tree
    # weight 0: decode only -> B (4) wins over A (6)
    rows = _rows({A: 3, C: 4}, {A: 30, C: 7}, loads, new, config=RouterConfig(overlap_score_weight=0))
    assert _pick(rows, 0.0, random.Random(0))[0] == B


def test_prefill_never_negative_when_overlap_exceeds_prompt() -> None:
    rows = _rows({A: 9}, {A: 9}, {}, {A: 4, B: 4, C: 4}, isl=64)
    assert rows.prefill[0] == 0.0


def test_equal_logits_and_tree_sizes_draw_uniformly() -> None:
    rows = _rows({}, {}, {}, {A: 4, B: 4, C: 4})
    rng = random.Random(42)
    picks = Counter(_pick(rows, 0.0, rng)[0] for _ in range(3000))
    assert set(picks) == {A, B, C} and min(picks.values()) > 850
    assert select(rows, 0.0, random.Random(1))[1] is Reason.tie_random


def test_only_candidate_and_none() -> None:
    matches = IndexMatches()
    rows = score([A], matches, {}, lambda w: 4, isl_tokens=64, block_size=16, config=RouterConfig())
    assert select(rows, 0.0, random.Random(0)) == (0, Reason.only_candidate)
    with pytest.raises(NoCandidates):
        select(score([], matches, {}, len, isl_tokens=64, block_size=16, config=RouterConfig()), 0.0,
               random.Random(0))


def test_tier_credits() -> None:
    # device 2 blocks, host holds 5, disk 8: 2 + 0.75*3 + 0.25*3 = 5.0
    depths = {Tier.device: 2, Tier.host_pinned: 5, Tier.disk: 8}
    assert effective_overlap(depths, DEFAULT_TIER_CREDITS) == 5.0
    assert effective_overlap(depths, None) == 2.0
    # host shorter than device adds nothing; disk beyond device does
    assert effective_overlap({Tier.device: 4, Tier.host_pinned: 3, Tier.disk: 6}, DEFAULT_TIER_CREDITS) == 4.5
    credits = RouterConfig(tier_credits=DEFAULT_TIER_CREDITS)
    rows = _rows({A: 2}, {A: 2}, {}, {A: 4, B: 4, C: 4}, isl=128, config=credits,
                 by_tier={Tier.device: {A: 2}, Tier.host_pinned: {A: 5}, Tier.disk: {A: 8}})
    row = rows.rows()[0]
    assert row.effective_overlap == 5.0 and row.prefill_blocks == 3.0 and row.overlap_blocks == 2
    assert row.overlap_by_tier == {Tier.device: 2, Tier.host_pinned: 5, Tier.disk: 8}


@pytest.mark.parametrize("bad", [{"overlap_score_weight": -1}, {"temperature": -0.1}, {"temperature": math.inf},
                                 {"tier_credits": {Tier.host_pinned: 1.5}}, {"tier_credits": {Tier.device: 0.5}}])
def test_config_validation(bad: dict) -> None:
    with pytest.raises(ValueError):
        RouterConfig(**bad)


def test_temperature_sampling_matches_the_softmax() -> None:
    """Chi-square over 20k seeded draws against p_i ∝ exp(-(logit_i / range) / T)."""
    rows = _rows({A: 3, C: 4}, {A: 30, C: 7}, {A: Load(5, 32, 2), C: Load(10, 100, 3)}, {A: 1, B: 4, C: 0})
    temperature = 0.5
    logits = rows.logit  # 9, 8, 16.25; range 8.25
    weights = [math.exp(-(v / 8.25) / temperature) for v in logits]
    expected = [w / sum(weights) for w in weights]
    rng = random.Random(1234)
    n = 20_000
    counts = Counter(_pick(rows, temperature, rng)[0] for _ in range(n))
    chi2 = sum((counts[w] - n * p) ** 2 / (n * p) for w, p in zip(rows.workers, expected, strict=True))
    assert chi2 < 13.82  # df = 2, p = 0.001
    assert select(rows, temperature, rng)[1] is Reason.sampled


def test_router_end_to_end_reserve_and_explain() -> None:
    router = Router(block_size=4, rng=random.Random(0))
    tokens = list(range(1, 13))  # 3 blocks
    local = local_block_hashes(tokens, 4)
    seq = sequence_hashes(local)
    router.index.apply(RouterEvent(1, Stored(None, seq[:2], local[:2])))
    d = router.route([A, B], token_ids=tokens, request_id="r1", reserve=True)
    # A: p = (12 - 8)/4 = 1, d = 3 -> 4;  B: p = 3, d = 3 -> 6
    assert (d.worker, d.overlap_blocks, d.required_blocks, d.reason) == (A, 2, 3, Reason.lowest_logit)
    assert [c.logit for c in d.candidates] == [4.0, 6.0]
    assert router.sequences.load(A) == Load(active_blocks=3, active_prefill_tokens=4, requests=1)
    # the same prompt again: A's in-flight blocks make its decode cost 3 + 0 new
    d2 = router.route([A, B], local_hashes=local)
    assert [c.decode_blocks for c in d2.candidates] == [3, 3]
    assert [c.prefill_blocks for c in d2.candidates] == [2.0, 3.0]  # A: (4 in flight + 4) / 4


def test_approximate_mode_learns_from_its_own_decisions() -> None:
    from kvctl.core.router.approx import ApproxConfig, ApproxIndexer

    router = Router(block_size=4, rng=random.Random(0), approx=ApproxIndexer(ApproxConfig(ttl_s=120.0)))
    tokens = list(range(1, 13))
    first = router.route([A, B], token_ids=tokens, request_id="r1", reserve=True, now=0.0)
    router.sequences.free("r1")
    again = router.route([A, B], token_ids=tokens, now=10.0)
    assert again.worker == first.worker and again.overlap_blocks == 3  # learned without any KV event
    assert router.tick(now=120.0) == ([], 3)
    assert router.route([A, B], token_ids=tokens, now=121.0).overlap_blocks == 0
    with pytest.raises(ValueError):
        Router(index=router.index, approx=ApproxIndexer())


@settings(max_examples=300, deadline=None)
@given(overlaps=st.lists(st.integers(0, 40), min_size=1, max_size=20),
       host=st.lists(st.integers(0, 60), min_size=20, max_size=20),
       isl=st.integers(0, 700), block_size=st.sampled_from([1, 16, 64]),
       weight=st.floats(0, 8, allow_nan=False), credits=st.booleans(), same_new=st.booleans())
def test_nothing_in_flight_prices_as_every_load_zero(overlaps: list[int], host: list[int], isl: int, block_size: int,
                                                    weight: float, credits: bool, same_new: bool) -> None:
    """With no loads the columns are built without a per-worker loop: the same numbers as pricing every
    candidate with an explicit zero load, tier credits and a per-worker new-block count included."""
    workers = [(i, 0) for i in range(len(overlaps))]
    matches = IndexMatches(scores={w: d for w, d in zip(workers, overlaps, strict=True) if d},
                           tree_sizes={w: d * 3 for w, d in zip(workers, overlaps, strict=True)},
                           by_tier={Tier.device: dict(zip(workers, overlaps, strict=True)),
                                    Tier.host_pinned: dict(zip(workers, host, strict=False))})
    config = RouterConfig(overlap_score_weight=weight, tier_credits=DEFAULT_TIER_CREDITS if credits else None)
    n_blocks = isl // block_size
    new_blocks = n_blocks if same_new else (lambda w: w[0] % 3)
    zero = {w: Load() for w in workers}
    fast = score(workers, matches, {}, new_blocks, isl_tokens=isl, block_size=block_size, config=config)
    loop = score(workers, matches, zero, new_blocks, isl_tokens=isl, block_size=block_size, config=config)
    assert (fast.effective, fast.prefill, fast.decode, fast.logit) == (loop.effective, loop.prefill, loop.decode,
                                                                       loop.logit)
    assert select(fast, 0.0, random.Random(1)) == select(loop, 0.0, random.Random(1))
