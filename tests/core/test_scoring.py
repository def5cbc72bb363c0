"""Dynamo 1.6.1's cost function (docs/contract.md): by hand, and against a small exact reference model."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.core.events import RouterEvent, Stored, Tier
from kvctl.core.hashing import local_block_hashes, sequence_hashes
from kvctl.core.index import IndexMatches
from kvctl.core.names import Role
from kvctl.core.router.router import Router
from kvctl.core.router.scoring import (
    BadKnob,
    NoCandidates,
    Reason,
    RouterConfig,
    booked_prefill_tokens,
    score,
    select,
)
from kvctl.core.router.sequences import Load

A, B, C = (1, 0), (2, 0), (3, 1)
DEFAULT = RouterConfig()


def _scores(device, loads, new_blocks, *, isl=64, bs=16, config=DEFAULT, host=None, disk=None, trees=None):
    by_tier = {Tier.device: device, Tier.host_pinned: host or {}, Tier.disk: disk or {}} if host or disk else {}
    matches = IndexMatches(scores=device, tree_sizes=trees or {}, by_tier=by_tier)
    return score([A, B, C], matches, loads, new_blocks.__getitem__, isl_tokens=isl, block_size=bs, config=config)


# ----- the reference model: the formula of docs/contract.md, one worker at a time, in exact fractions -----------


@dataclass
class Rank:
    device: int
    host: int
    disk: int
    active_prefill: int
    active_blocks: int
    new_blocks: int
    requests: int


def reference_logits(ranks: list[Rank], isl: int, bs: int, c: RouterConfig) -> list[Fraction]:
    f = Fraction
    request_blocks = -(-isl // bs)
    floor = min(r.active_prefill for r in ranks)
    out = []
    for r in ranks:
        decay = f(1)
        if c.track_prefill_tokens and c.overlap_score_credit_decay > 0 and request_blocks:
            decay = 1 / (1 + f(c.overlap_score_credit_decay) * (f(r.active_prefill - floor, bs) / request_blocks))
        credit = (f(c.overlap_score_credit) * decay * r.device + f(c.host_cache_hit_weight) * r.host
                  + f(c.disk_cache_hit_weight) * r.disk)
        decode = (r.active_blocks if c.track_active_blocks else 0) + r.new_blocks
        requests = f(c.decode_active_request_weight) * r.requests
        if not c.track_prefill_tokens and c.overlap_score_credit > 0:
            out.append(max(decode - credit, f(0)) + requests)
            continue
        raw = f(r.active_prefill + (isl if c.track_prefill_tokens else 0), bs)
        out.append(f(c.prefill_load_scale) * max(raw - credit, f(0)) + decode + requests)
    return out


knob = st.one_of(st.just(0.0), st.floats(0, 4, allow_nan=False, allow_infinity=False))
configs = st.builds(RouterConfig, overlap_score_credit=knob, overlap_score_credit_decay=knob,
                    prefill_load_scale=knob, decode_active_request_weight=knob, host_cache_hit_weight=knob,
                    disk_cache_hit_weight=knob, track_prefill_tokens=st.booleans(),
                    track_active_blocks=st.booleans())
ranks = st.builds(Rank, st.integers(0, 12), st.integers(0, 6), st.integers(0, 6), st.integers(0, 400),
                  st.integers(0, 40), st.integers(0, 12), st.integers(0, 5))


@settings(max_examples=400, deadline=None)
@given(rows=st.lists(ranks, min_size=1, max_size=8), isl=st.integers(1, 200), bs=st.sampled_from([1, 4, 16]),
       config=configs)
def test_logits_are_the_reference_models(rows: list[Rank], isl: int, bs: int, config: RouterConfig) -> None:
    workers = [(i, 0) for i in range(len(rows))]
    matches = IndexMatches(scores={w: r.device for w, r in zip(workers, rows, strict=True) if r.device},
                           by_tier={Tier.device: {w: r.device for w, r in zip(workers, rows, strict=True)},
                                    Tier.host_pinned: {w: r.host for w, r in zip(workers, rows, strict=True)},
                                    Tier.disk: {w: r.disk for w, r in zip(workers, rows, strict=True)}})
    loads = {w: Load(r.active_blocks, r.active_prefill, r.requests) for w, r in zip(workers, rows, strict=True)}
    new = {w: r.new_blocks for w, r in zip(workers, rows, strict=True)}
    got = score(workers, matches, loads, new.__getitem__, isl_tokens=isl, block_size=bs, config=config)
    want = reference_logits(rows, isl, bs, config)
    assert got.logit == pytest.approx([float(v) for v in want], rel=1e-9, abs=1e-9)
    i, reason = select(got, 0.0, random.Random(0))
    assert got.logit[i] == min(got.logit)
    assert reason in ((Reason.only_candidate,) if len(rows) == 1 else (Reason.lowest_logit, Reason.tie_random))


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(ranks, min_size=1, max_size=8), isl=st.integers(1, 200), bs=st.sampled_from([1, 4, 16]),
       config=configs)
def test_nothing_in_flight_prices_as_every_load_zero(rows: list[Rank], isl: int, bs: int,
                                                    config: RouterConfig) -> None:
    """Idle workers may be left out of `loads`: the same numbers as pricing each with an explicit zero load."""
    workers = [(i, 0) for i in range(len(rows))]
    device = {w: r.device for w, r in zip(workers, rows, strict=True) if r.device}
    tiers = {Tier.device: device, Tier.host_pinned: {w: r.host for w, r in zip(workers, rows, strict=True) if r.host},
             Tier.disk: {w: r.disk for w, r in zip(workers, rows, strict=True) if r.disk}}
    matches = IndexMatches(scores=device, by_tier=tiers if any(r.host or r.disk for r in rows) else {})
    blocks = isl // bs
    empty = score(workers, matches, {}, blocks, isl_tokens=isl, block_size=bs, config=config)
    zero = score(workers, matches, {w: Load() for w in workers}, blocks, isl_tokens=isl, block_size=bs,
                 config=config)
    assert (empty.logit, empty.decay, empty.effective, empty.prefill, empty.raw_prefill, empty.decode) == (
        zero.logit, zero.decay, zero.effective, zero.prefill, zero.raw_prefill, zero.decode)


# ----- by hand ------------------------------------------------------------------------------------------


def test_tier_credit_is_cumulative_and_on_by_default() -> None:
    # docs/contract.md's example: 1 device block, host reaches 3, disk reaches 5: credit 1 + 0.75*2 + 0.25*2 = 3.
    # ISL 22 tokens of B=4: raw 5.5 -> prefill 2.5, decode 5 full blocks (the partial one is not one) -> 7.5
    s = _scores({A: 1, B: 2}, {}, {A: 5, B: 5, C: 5}, isl=22, bs=4, host={A: 2}, disk={A: 2})
    rows = s.rows()
    assert [r.logit for r in rows] == [7.5, 8.5, 10.5]
    assert rows[0].credit_by_tier == {Tier.device: 1.0, Tier.host_pinned: 1.5, Tier.disk: 0.5, Tier.external: 0.0}
    assert rows[0].effective_overlap == 3.0 and rows[0].overlap_by_tier == {Tier.device: 1, Tier.host_pinned: 2,
                                                                            Tier.disk: 2}
    assert rows[0].credit == 3.0
    assert select(s, 0.0, random.Random(0)) == (0, Reason.lowest_logit)


def test_external_blocks_earn_the_disk_weight() -> None:
    """Dynamo counts the external tier's continuation in its disk extension: disk weight, after the disk tier."""
    matches = IndexMatches(scores={A: 1}, by_tier={Tier.device: {A: 1}, Tier.disk: {A: 1}, Tier.external: {A: 2}})
    s = score([A], matches, {}, 5, isl_tokens=20, block_size=4, config=DEFAULT)
    row = s.rows()[0]
    assert (row.effective_overlap, row.logit) == (1 + 0.25 * 3, 5 - 1.75 + 5)
    assert row.credit_by_tier == {Tier.device: 1.0, Tier.host_pinned: 0.0, Tier.disk: 0.25, Tier.external: 0.5}


def test_decay_shrinks_device_credit_by_backlog_above_the_least_loaded() -> None:
    # ISL 64 / 16 = 4 request blocks. A: 4 cached, 64 tokens in flight above B's 0 -> decay 1/(1 + 2*(4/4)) = 1/3
    config = RouterConfig(overlap_score_credit_decay=2)
    s = _scores({A: 4, B: 4}, {A: Load(0, 64, 1)}, {A: 4, B: 4, C: 4}, config=config)
    assert s.decay == [1 / 3, 1.0, 1.0]
    # A: raw (64 + 64)/16 = 8, credit 4/3 -> 6.667 + 4;  B: raw 4 - 4 = 0 -> 4;  C: 4 + 4
    assert s.logit == pytest.approx([8 - 4 / 3 + 4, 4.0, 8.0])
    assert RouterConfig().override(track_prefill_tokens=False).overlap_score_credit_decay == 0  # untouched
    off = _scores({A: 4, B: 4}, {A: Load(0, 64, 1)}, {A: 4, B: 4, C: 4},
                  config=config.override(track_prefill_tokens=False))
    assert off.decay == [1.0, 1.0, 1.0]  # no prefill tracking, no decay


def test_without_prefill_tracking_credit_offsets_decode() -> None:
    config = RouterConfig(track_prefill_tokens=False, decode_active_request_weight=0.5)
    s = _scores({A: 3}, {A: Load(2, 100, 2)}, {A: 1, B: 4, C: 4}, config=config)
    assert s.logit == [max(3 - 3, 0) + 1.0, 4.0, 4.0]  # A: decode 2+1 - credit 3 -> 0, plus 0.5 * 2 requests
    no_credit = _scores({A: 3}, {A: Load(2, 100, 2)}, {A: 1, B: 4, C: 4},
                        config=config.override(overlap_score_credit=0))
    assert no_credit.logit == [100 / 16 + 3 + 1.0, 4.0, 4.0]  # in-flight prefill still counts, the prompt not


def test_exact_ties_are_uniform_whatever_the_tree_sizes() -> None:
    s = _scores({}, {}, {A: 4, B: 4, C: 4}, trees={A: 100})
    assert len(set(s.logit)) == 1
    rng = random.Random(7)
    picks = Counter(select(s, 0.0, rng) for _ in range(3000))
    assert set(picks) == {(0, Reason.tie_random), (1, Reason.tie_random), (2, Reason.tie_random)}
    assert min(picks.values()) > 900  # uniform: no smallest-tree rule


def test_only_candidate_and_none() -> None:
    one = score([A], IndexMatches(), {}, 2, isl_tokens=32, block_size=16, config=DEFAULT)
    assert select(one, 0.0, random.Random(0)) == (0, Reason.only_candidate)
    with pytest.raises(NoCandidates):
        select(score([], IndexMatches(), {}, 2, isl_tokens=32, block_size=16, config=DEFAULT), 0.0, random.Random(0))


@pytest.mark.parametrize("knob", ["overlap_score_credit", "overlap_score_credit_decay", "prefill_load_scale",
                                  "decode_active_request_weight", "host_cache_hit_weight", "disk_cache_hit_weight",
                                  "router_temperature"])
@pytest.mark.parametrize("value", [-0.5, math.inf, math.nan, True])
def test_every_knob_is_finite_and_non_negative(knob: str, value: float) -> None:
    with pytest.raises(BadKnob, match=knob):
        RouterConfig().override(**{knob: value})


def test_legacy_names() -> None:
    c = RouterConfig().override(overlap_score_weight=2.0, prefill_load_scale=0.5, temperature=0.3)
    assert (c.prefill_load_scale, c.overlap_score_credit, c.router_temperature) == (2.0, 1.0, 0.3)
    zero = RouterConfig(overlap_score_credit=0.7).override(overlap_score_weight=0)
    assert (zero.prefill_load_scale, zero.overlap_score_credit) == (0.0, 0.0)  # 0 also zeroes the credit
    assert RouterConfig().override(temperature=0.3, router_temperature=0.9).router_temperature == 0.9
    assert DEFAULT.override(overlap_score_weight=None) is DEFAULT  # nothing given: no new config per route
    with pytest.raises(TypeError, match="colour"):
        RouterConfig().override(colour=1.0)
    with pytest.raises(BadKnob, match="track_prefill_tokens"):
        RouterConfig(track_prefill_tokens=1)  # type: ignore[arg-type]


def test_booked_prefill_rounds_half_away_from_zero() -> None:
    assert booked_prefill_tokens(22, 2.5, 4, DEFAULT) == 12
    assert booked_prefill_tokens(22, 2.625, 4, DEFAULT) == 11  # 10.5 -> 11, not Python's banker's 10
    assert booked_prefill_tokens(8, 5.0, 4, DEFAULT) == 0  # weights above 1 cannot book less than nothing
    assert booked_prefill_tokens(22, 2.5, 4, RouterConfig(track_prefill_tokens=False)) == 0


def test_temperature_sampling_matches_the_softmax() -> None:
    """Chi-square over 20k seeded draws against p_i ∝ exp(-(logit_i - min) / (range * T))."""
    s = _scores({A: 3, C: 4}, {A: Load(5, 32, 2), C: Load(10, 100, 3)}, {A: 1, B: 4, C: 0})
    temperature = 0.5
    low, spread = min(s.logit), max(s.logit) - min(s.logit)
    weights = [math.exp(-(v - low) / (spread * temperature)) for v in s.logit]
    expected = [w / sum(weights) for w in weights]
    rng = random.Random(1234)
    n = 20_000
    counts = Counter(select(s, temperature, rng)[0] for _ in range(n))
    chi2 = sum((counts[i] - n * p) ** 2 / (n * p) for i, p in enumerate(expected))
    assert chi2 < 13.82  # df = 2, p = 0.001
    assert select(s, temperature, rng)[1] is Reason.sampled


def test_router_books_prefill_with_tier_credit_and_explains() -> None:
    router = Router(block_size=4, rng=random.Random(0))
    tokens = list(range(1, 13))  # 3 blocks
    local = local_block_hashes(tokens, 4)
    seq = sequence_hashes(local)
    router.index.apply(RouterEvent(1, Stored(None, seq[:1], local[:1])))
    router.index.apply(RouterEvent(1, Stored(seq[0], seq[1:3], local[1:3], Tier.host_pinned)))  # parent on device
    d = router.route([A, B], token_ids=tokens, request_id="r1", reserve=True)
    # A: credit 1 + 0.75 * 2 = 2.5, raw 3 -> 0.5 + 3 decode = 3.5;  B: 3 + 3 = 6
    assert (d.worker, d.overlap_blocks, d.effective_overlap, d.required_blocks) == (A, 1, 2.5, 3)
    assert [c.logit for c in d.candidates] == [3.5, 6.0]
    assert router.sequences.load(A) == Load(active_blocks=3, active_prefill_tokens=12 - 10, requests=1)
    again = router.route([A, B], local_hashes=local, overrides={"decode_active_request_weight": 2.0})
    assert [c.decode_blocks for c in again.candidates] == [3, 3]  # A's blocks are in flight already
    assert [c.logit for c in again.candidates] == [(2 + 12) / 4 - 2.5 + 3 + 2.0, 6.0]


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


def test_a_disaggregated_fleets_pools_price_as_dynamos_frontend_logged() -> None:
    """The numbers a 1.6.1 frontend logged on a 2 prefill + 2 decode mocker fleet at B=16 (issue 38): a prefill
    pick has no decode term and full overlap credit; a decode pick weighs the prompt's full blocks alone."""
    router = Router(block_size=16, rng=random.Random(0))
    prompt = list(range(100))  # 6 full blocks and 4 tokens
    cold = router.route([A, B], token_ids=prompt, role=Role.prefill)
    assert [c.logit for c in cold.candidates] == [6.25, 6.25] and cold.candidates[0].decode_blocks == 0
    local = local_block_hashes(prompt, 16)
    router.index.apply(RouterEvent(1, Stored(None, sequence_hashes(local), local)))
    warm = router.route([A, B], token_ids=prompt, role=Role.prefill)
    assert (warm.worker, [c.logit for c in warm.candidates]) == (A, [0.25, 6.25])
    decode = router.route([A, B], token_ids=prompt, role=Role.decode)
    assert [c.logit for c in decode.candidates] == [6.0, 6.0]  # A's cached blocks earn a decode pick nothing
    assert [c.logit for c in router.route([A], token_ids=prompt[:81], role=Role.decode).candidates] == [5.0]


def test_the_pools_book_as_dynamos_routers_do() -> None:
    """The prefill router books prefill tokens and no blocks; the decode router books no prefill tokens and the
    prompt's blocks as its own, so a second request of the same prompt on that worker pays for all of them."""
    router = Router(block_size=4, rng=random.Random(0))
    prompt = list(range(1, 23))  # 5 full blocks of 4
    router.route([A], token_ids=prompt, request_id="p", reserve=True, role=Role.prefill)
    assert router.sequences.load(A) == Load(active_blocks=0, active_prefill_tokens=22, requests=1)
    router.route([B], token_ids=prompt, request_id="d", reserve=True, role=Role.decode)
    assert router.sequences.load(B) == Load(active_blocks=5, active_prefill_tokens=0, requests=1)
    again = router.route([B], token_ids=prompt, role=Role.decode)
    assert again.candidates[0].decode_blocks == 10  # not deduplicated against "d", as Dynamo assumes no reuse
    aggregated = router.route([B], token_ids=prompt)
    assert aggregated.candidates[0].decode_blocks == 10  # "d"'s blocks are its own: no prompt prefix in flight
    prefill_pool = router.route([A, B], token_ids=prompt, role=Role.prefill)
    assert [c.decode_blocks for c in prefill_pool.candidates] == [0, 0]  # B's 5 blocks in flight: no decode term


def test_an_aggregated_pool_routes_as_configured() -> None:
    config = RouterConfig(overlap_score_credit=2.0)
    assert config.for_pool(Role.aggregated) is config
    assert config.for_pool(Role.prefill).overlap_score_credit == 2.0
    decode = config.for_pool(Role.decode)
    assert (decode.overlap_score_credit, decode.track_prefill_tokens, decode.assume_kv_reuse) == (0.0, False, False)
