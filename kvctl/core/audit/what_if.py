"""`kvctl audit --what-if KNOB=VALUE`: the recent decisions priced again under other knobs, with the index and the
loads each was judged under, to say how the picks and the avoidable prefill would change.

Each decision's candidates are priced again by the cost function itself (`scoring.score`), from the inputs its
first pricing kept (`Scores`: overlaps per tier, in-flight prefill and blocks, requests), so a decision priced
again under its own knobs gives back the same logits, and a router started with the other knobs that hears the
same decisions prices them as this does. What a different pick would have changed later (loads, caches) is not
followed: each decision stands as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvctl.core.audit.verdict import Outcome, Verdict
from kvctl.core.index import IndexMatches
from kvctl.core.names import WorkerKey
from kvctl.core.router.scoring import KNOBS, RouterConfig, Scores, score
from kvctl.core.router.sequences import Load


@dataclass(frozen=True, slots=True)
class Priced:
    """A judged decision with what its pricing read: enough to price it again."""

    verdict: Verdict
    scores: Scores
    isl_tokens: int


def reprice(priced: Priced, knobs: Mapping[str, float | bool]) -> Scores:
    """The decision's candidates priced under its knobs overridden by `knobs` (Dynamo names)."""
    old = priced.scores
    block_size = priced.verdict.seen.block_size
    prompt = priced.isl_tokens if old.config.track_prefill_tokens else 0
    workers = old.workers
    matches = IndexMatches({w: n for w, n in zip(workers, old.overlap, strict=True) if n},
                           dict(zip(workers, old.tree_size, strict=True)), {t: dict(s) for t, s in old.by_tier.items()})
    loads = {w: Load(old.decode[i], round(old.raw_prefill[i] * block_size) - prompt, old.requests[i])
             for i, w in enumerate(workers)}
    return score(workers, matches, loads, 0, isl_tokens=priced.isl_tokens, block_size=block_size,
                 config=old.config.override(**knobs), busy=dict(zip(workers, old.busy, strict=True)))


def lowest(scores: Scores) -> tuple[WorkerKey, ...]:
    """The workers a router with these scores picks among (temperature 0: the lowest logits, drawn uniformly)."""
    least = min(scores.logit, default=0.0)
    return tuple(w for w, logit in zip(scores.workers, scores.logit, strict=True) if logit == least)


def what_if(decisions: Iterable[Priced], knobs: Mapping[str, float | bool]) -> dict[str, Any]:
    """How the decisions would go under `knobs`: how many picks change, the optimal share and the avoidable prefill
    then (a draw among equals counted at its expected value), beside the actual ones."""
    n = changed = optimal_now = cached = avoidable_now = 0
    optimal_then = avoidable_then = 0.0
    for priced in decisions:
        verdict = priced.verdict
        if verdict.outcome is Outcome.unknown:
            continue
        n += 1
        cached_of = {r.worker: r.cached for r in verdict.rows}
        picks = lowest(reprice(priced, knobs))
        changed += verdict.seen.chosen not in picks
        then = sum(verdict.best - cached_of[w] for w in picks) / len(picks)
        avoidable_now += verdict.avoidable_tokens
        avoidable_then += then * verdict.seen.block_size
        if verdict.best:
            cached += 1
            optimal_now += verdict.chosen_overlap == verdict.best
            optimal_then += sum(cached_of[w] == verdict.best for w in picks) / len(picks)
    return {"knobs": dict(knobs), "decisions": n, "changed": changed,
            "optimal_share": optimal_now / cached if cached else None,
            "optimal_share_then": optimal_then / cached if cached else None,
            "avoidable_prefill_tokens": avoidable_now, "avoidable_prefill_tokens_then": round(avoidable_then)}


def parse_knobs(items: Iterable[str]) -> dict[str, float | bool]:
    """`KNOB=VALUE` items (Dynamo's knob names) as knobs, each checked as the router checks it; ValueError naming
    the first bad one."""
    knobs: dict[str, float | bool] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or name not in KNOBS:
            raise ValueError(f"expected KNOB=VALUE with a knob of {', '.join(KNOBS)}; got {item!r}")
        if name == "track_prefill_tokens":
            if text not in ("true", "false"):
                raise ValueError(f"{name} is true or false, got {text!r}")
            knobs[name] = text == "true"
            continue
        try:
            knobs[name] = float(text)
        except ValueError:
            raise ValueError(f"{name} must be a number, got {text!r}") from None
    RouterConfig().override(**knobs)  # BadKnob (a ValueError) names a value out of its range
    return knobs
