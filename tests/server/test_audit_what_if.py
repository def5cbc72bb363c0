"""`audit --what-if`: a decision priced again under other knobs picks as a router started with those knobs would,
and under its own knobs gives back its own logits."""

from __future__ import annotations

import random

import pytest

from kvctl.core.audit.what_if import lowest, reprice, what_if
from kvctl.core.events import RouterEvent, Stored
from kvctl.core.events.plane import ActiveSequenceEvent, AddRequest
from kvctl.core.hashing import local_block_hashes, sequence_hashes
from kvctl.core.router.scoring import RouterConfig
from kvctl.server.state import Fleet

B = 16
WORKERS = (1, 2, 3)


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 50_000) for _ in range(4 * B)] for _ in range(3)]
    return [prefixes[n % 3] + [rng.randrange(1, 50_000) for _ in range(rng.randrange(0, 3) * B)] for n in range(24)]


def heard(config: RouterConfig, seed: int) -> Fleet:
    """A fleet hearing a frontend's decisions: before each, some worker stores a prefix and some load comes and
    goes; the frontend picks at random (the audit judges whatever it picked)."""
    rng = random.Random(seed)
    fleet = Fleet(block_size=B, seed=0, config=config)
    for w in WORKERS:
        fleet.apply("default", [RouterEvent(w, Stored(None, [w * 1000], [w * 7919]))], 0.0)
    in_flight = fleet.model("default").router.sequences
    for n, tokens in enumerate(prompts(seed)):
        local = local_block_hashes(tokens, B)
        seq = sequence_hashes(local)
        holder, depth = rng.choice(WORKERS), rng.randrange(1, len(local) + 1)
        fleet.apply("default", [RouterEvent(holder, Stored(None, seq[:depth], local[:depth]))], 0.0)
        if rng.random() < 0.6:
            in_flight.add(f"load-{n}", (rng.choice(WORKERS), 0), [rng.getrandbits(64) for _ in range(3)],
                          rng.randrange(0, 200), 0.0)
        add = AddRequest(seq, True, None, None)
        fleet.audit.peer(ActiveSequenceEvent(f"r{n}", rng.choice(WORKERS), 0, add, 77), add, "default", {}, 1.0)
    return fleet


KNOBS = [{"overlap_score_credit": 0.0}, {"prefill_load_scale": 4.0}, {"overlap_score_credit": 2.0},
         {"track_prefill_tokens": False}, {"overlap_score_credit_decay": 1.0, "decode_active_request_weight": 3.0}]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_decision_priced_again_under_its_own_knobs_gives_back_its_logits(seed: int) -> None:
    fleet = heard(RouterConfig(), seed)
    for priced in fleet.audit.ledger.priced(0.0):
        assert reprice(priced, {}).logit == priced.scores.logit
        assert lowest(reprice(priced, {})) == priced.verdict.kvctl_picks


@pytest.mark.parametrize("knobs", KNOBS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
@pytest.mark.parametrize("seed", [1, 2])
def test_what_if_picks_as_a_router_started_with_those_knobs(knobs: dict[str, float | bool], seed: int) -> None:
    here = heard(RouterConfig(), seed)
    there = heard(RouterConfig().override(**knobs), seed)
    mine = {p.verdict.seen.request_id: lowest(reprice(p, knobs)) for p in here.audit.ledger.priced(0.0)}
    theirs = {p.verdict.seen.request_id: p.verdict.kvctl_picks for p in there.audit.ledger.priced(0.0)}
    assert mine == theirs and len(mine) == 24
    summary = what_if(here.audit.ledger.priced(0.0), knobs)
    agreeing_there = sum(p.verdict.seen.chosen in p.verdict.kvctl_picks for p in there.audit.ledger.priced(0.0))
    assert summary["decisions"] == 24 and summary["changed"] == 24 - agreeing_there


def test_the_same_knobs_change_nothing_and_credit_zero_loses_the_cache() -> None:
    fleet = heard(RouterConfig(), 5)
    same = what_if(fleet.audit.ledger.priced(0.0), {})
    disagreeing = sum(p.verdict.seen.chosen not in p.verdict.kvctl_picks for p in fleet.audit.ledger.priced(0.0))
    assert same["changed"] == disagreeing
    blind = what_if(fleet.audit.ledger.priced(0.0), {"overlap_score_credit": 0.0})
    best = what_if(fleet.audit.ledger.priced(0.0), {"overlap_score_credit": 4.0})
    assert best["optimal_share_then"] > blind["optimal_share_then"]
    assert best["avoidable_prefill_tokens_then"] < blind["avoidable_prefill_tokens_then"]
