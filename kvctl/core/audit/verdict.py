"""One routed decision judged against kvctl's index at the moment it was heard (docs/audit.md).

A router's own counters judge its decisions by its own view, and go blind with it: a router told to ignore the
cache reports no overlap lost, because it no longer looks. kvctl judges each decision from its own index, which
equals Dynamo's: how much cache each candidate held, whether the pick held the most, what prefill that choice
made avoidable, what kvctl's cost function would have picked, and, for every pick short of the most cache, a
reason read from the numbers, or "unexplained". Pure: the caller gathers the scores and the index's health.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from kvctl.core.names import Role, WorkerKey
from kvctl.core.router.scoring import Scores


class Outcome(StrEnum):
    optimal = "optimal"  # the pick held the most cache of any candidate (or none held any)
    suboptimal = "suboptimal"  # another candidate held more of the prompt
    unknown = "unknown"  # kvctl cannot judge it (`Why` says what it could not see)


class Why(StrEnum):
    """The reason given with an outcome; the values are stable metric labels."""

    max_overlap = "max_overlap"  # optimal: the pick held the most
    no_overlap = "no_overlap"  # optimal: no candidate held any of the prompt
    tie = "tie"  # the pick's cost tied with a worker holding more: a draw between equals
    load_balance = "load_balance"  # kvctl's cost function also prices the pick lower: load outweighed cache
    busy = "busy"  # every worker holding the most was busy
    sampled = "sampled"  # the router samples (temperature > 0) and drew a costlier worker
    cache_ignored = "cache_ignored"  # the router gives cached blocks no credit (overlap_score_credit 0)
    index_behind = "index_behind"  # kvctl's index did not yet hold what the router saw on the pick
    approximate = "approximate"  # the model is routed without KV events: kvctl's index is a prediction
    unexplained = "unexplained"  # none of the above: a pick kvctl prices higher, with less cache
    unknown_worker = "unknown_worker"  # the pick is no candidate kvctl knows for the model
    unresolved = "unresolved"  # the prompt's blocks could not be looked up (keyed hashes, a walk over budget)
    decode_pool = "decode_pool"  # a disaggregated fleet's decode pick, which weighs no cache by design


class Agreement(StrEnum):
    agree = "agree"  # kvctl's cost function picks the same worker
    tie = "tie"  # the pick is one of several kvctl prices equally lowest
    disagree = "disagree"
    unknown = "unknown"


@dataclass(frozen=True, slots=True)
class Seen:
    """What one decision says and what kvctl could see of it, gathered by the caller."""

    request_id: str
    model: str
    router: str  # "kvctl", or the router id of the Dynamo frontend that published it
    at: float
    chosen: WorkerKey
    blocks: int  # the prompt's full blocks
    block_size: int
    role: Role = Role.aggregated
    resolved: int = 0  # blocks of the prompt found in the index's tree
    unresolved: str | None = None  # why the prompt could not be looked up at all, or None
    prefill_hint: int | None = None  # the router's own prefill tokens for the pick (replica sync), when it tracks them
    stale: Mapping[WorkerKey, str] | None = None  # candidates whose stream is not caught up, and why
    credit: float = 1.0  # the pool's overlap_score_credit under the fleet's knobs
    router_blind: bool = False  # the router has never credited cache on its picks, though they held some
    temperature: float = 0.0
    approximate: bool = False


class Row(NamedTuple):
    """A candidate as it was when the decision was judged. `cached`: the prompt's blocks it holds on any tier, as
    Dynamo's decision counters count them (device, then the slower tiers continuing it, unweighted); `weighted`:
    the same with the tier weights, as Dynamo estimates a pick's cached tokens for its prefill hint. A tuple: a
    decision has a row per candidate, and kvctl's own are judged by the thousand."""

    worker: WorkerKey
    device: int
    cached: int
    weighted: float
    logit: float
    busy: bool


@dataclass(frozen=True, slots=True)
class Verdict:
    """`router_overlap`: the weighted cached blocks the router saw on its pick, from its prefill hint."""

    seen: Seen
    outcome: Outcome
    why: Why
    agreement: Agreement
    rows: tuple[Row, ...]
    best: int  # the most blocks any candidate held
    chosen_overlap: int
    avoidable_tokens: int  # (best - chosen overlap) x block size
    kvctl_picks: tuple[WorkerKey, ...]  # the workers kvctl prices lowest
    router_overlap: float | None

    @property
    def picked(self) -> Row | None:
        return next((r for r in self.rows if r.worker == self.seen.chosen), None)

    @property
    def optimal(self) -> tuple[WorkerKey, ...]:
        return tuple(r.worker for r in self.rows if r.cached == self.best)

    @property
    def cacheable_tokens(self) -> int:
        return self.best * self.seen.block_size


def judge(seen: Seen, scores: Scores | None) -> Verdict:
    """`scores`: the pool's candidates priced by kvctl now (`Router.assess`), None when the pick is no candidate.
    Read column by column (`Scores`), the rows built once: kvctl's own decisions are judged by the thousand."""
    rows, cached = ((), []) if scores is None else _rows(scores)
    workers: list[WorkerKey] = [] if scores is None else list(scores.workers)
    logits: list[float] = [] if scores is None else scores.logit
    best = max(cached, default=0)
    lowest = min(logits, default=0.0)
    kvctl_picks = tuple(w for w, logit in zip(workers, logits, strict=True) if logit == lowest)
    router_overlap = _router_overlap(seen)
    pick = rows[workers.index(seen.chosen)] if seen.chosen in workers else None
    if pick is None or seen.unresolved is not None or seen.role is Role.decode:
        why = Why.decode_pool if seen.role is Role.decode else \
            Why.unresolved if seen.unresolved is not None else \
            Why.index_behind if seen.stale and seen.chosen in seen.stale else Why.unknown_worker
        return Verdict(seen, Outcome.unknown, why, Agreement.unknown, rows, best, 0, 0, kvctl_picks, router_overlap)
    agreement = Agreement.disagree if seen.chosen not in kvctl_picks else \
        Agreement.tie if len(kvctl_picks) > 1 else Agreement.agree
    if pick.cached == best:
        why = Why.max_overlap if best else Why.no_overlap
        return Verdict(seen, Outcome.optimal, why, agreement, rows, best, best, 0, kvctl_picks, router_overlap)
    why = _why_not_best(seen, pick, [r for r in rows if r.cached == best], kvctl_picks, router_overlap)
    return Verdict(seen, Outcome.suboptimal, why, agreement, rows, best, pick.cached,
                   (best - pick.cached) * seen.block_size, kvctl_picks, router_overlap)


def _rows(scores: Scores) -> tuple[tuple[Row, ...], list[int]]:
    """The candidates' rows, and their cached blocks as a column."""
    overlap = scores.overlap
    if not scores.by_tier:  # no slower tier: what it holds is its device overlap (the common case, cheaper)
        return tuple(map(Row, scores.workers, overlap, overlap, map(float, overlap), scores.logit,
                         scores.busy)), overlap
    host_weight, disk_weight = scores.config.host_cache_hit_weight, scores.config.disk_cache_hit_weight
    rows = tuple(Row(w, dev, dev + h + d, dev + host_weight * h + disk_weight * d, logit, busy)
                 for w, dev, h, d, logit, busy in zip(scores.workers, overlap, scores.host, scores.disk, scores.logit,
                                                      scores.busy, strict=True))
    return rows, [r.cached for r in rows]


def _router_overlap(seen: Seen) -> float | None:
    """The weighted cached blocks the router estimated for its pick: its hint is ISL - round(weighted x B) prefill
    tokens, and the prompt's ISL is its full blocks plus under one block more, so this is a lower bound within one
    block (Dynamo 1.6.1 `initial_effective_prefill_tokens`; no hint when it does not track prefill tokens)."""
    if seen.prefill_hint is None:
        return None
    return max(0, seen.blocks * seen.block_size - seen.prefill_hint) / seen.block_size


def _why_not_best(seen: Seen, pick: Row, best_rows: Sequence[Row], kvctl_picks: Sequence[WorkerKey],
                  router_overlap: float | None) -> Why:
    """The first reason the numbers support, most certain first."""
    if seen.stale and seen.chosen in seen.stale or router_overlap is not None and router_overlap >= pick.weighted + 1:
        return Why.index_behind  # the router saw more cache on its pick than kvctl's index holds
    if seen.approximate:
        return Why.approximate
    if seen.credit == 0 or seen.router_blind or router_overlap == 0 and pick.weighted >= 1:
        return Why.cache_ignored  # credit 0, or (its index empty: a router with credit 0 takes no KV events) none seen
    if all(r.busy for r in best_rows) and not pick.busy:
        return Why.busy
    if seen.chosen in kvctl_picks:
        return Why.tie if any(r.worker in kvctl_picks for r in best_rows) else Why.load_balance
    if seen.temperature > 0:
        return Why.sampled
    return Why.unexplained
