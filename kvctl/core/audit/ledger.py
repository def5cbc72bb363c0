"""The audit's memory: the recent verdicts in a bounded ring (to explain one request, or summarise a window) and
running totals for `/metrics`, with the routers they are labelled by bounded too (docs/audit.md).

Pure: the caller passes the clock.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvctl.core.audit.verdict import Agreement, Outcome, Verdict, Why
from kvctl.core.audit.what_if import Priced
from kvctl.core.names import WorkerKey
from kvctl.core.router.scoring import Scores

RING = 4_096
"""Recent verdicts kept: minutes of a busy frontend's decisions, ~1 KB each with a few candidates, ~3 KB with 16."""
MAX_ROUTERS = 16
"""Router labels kept apart in the totals; a frontend's router id is new at every start, so past this many
the others are summed under "other" (the ring keeps each verdict's own id)."""
OTHER = "other"
PRICED = 1_024
"""Recent verdicts kept with their candidates' cost inputs, for `--what-if`: ~2 KB more each with 16 candidates."""
RATIO_BUCKETS = (0.0, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
"""Upper bounds of the chosen/best overlap histogram (a decision where some candidate held cache)."""


@dataclass
class Totals:
    """Running totals of one (model, router) label pair."""

    decisions: Counter[tuple[str, str]] = field(default_factory=Counter)  # (outcome, why)
    agreement: Counter[str] = field(default_factory=Counter)
    avoidable_tokens: int = 0
    cacheable_tokens: int = 0
    chosen_tokens: int = 0  # prompt tokens cached on the picks: Dynamo's "selected", as kvctl's index has them
    ratio_buckets: list[int] = field(default_factory=lambda: [0] * len(RATIO_BUCKETS))
    ratio_sum: float = 0.0
    ratio_count: int = 0


class AuditLedger:
    def __init__(self, ring: int = RING, max_routers: int = MAX_ROUTERS, priced: int = PRICED) -> None:
        self._ring: deque[Verdict] = deque(maxlen=ring)
        self._priced: deque[Priced] = deque(maxlen=priced)
        self._by_request: dict[str, Verdict] = {}
        self._max_routers = max_routers
        self._routers: set[str] = set()
        self.totals: dict[tuple[str, str], Totals] = {}
        self.seen = 0

    def add(self, verdict: Verdict, scores: Scores | None = None, isl_tokens: int = 0) -> None:
        """`scores` and `isl_tokens`: what the verdict's pricing read, kept for `--what-if`."""
        if scores is not None:
            self._priced.append(Priced(verdict, scores, isl_tokens))
        ring = self._ring
        if len(ring) == ring.maxlen:
            oldest = ring[0]
            if self._by_request.get(oldest.seen.request_id) is oldest:
                del self._by_request[oldest.seen.request_id]
        ring.append(verdict)
        self._by_request[verdict.seen.request_id] = verdict
        self.seen += 1
        totals = self.totals.setdefault((verdict.seen.model, self._label(verdict.seen.router)), Totals())
        totals.decisions[verdict.outcome.value, verdict.why.value] += 1
        totals.agreement[verdict.agreement.value] += 1
        totals.avoidable_tokens += verdict.avoidable_tokens
        if verdict.outcome is not Outcome.unknown:
            totals.cacheable_tokens += verdict.cacheable_tokens
            totals.chosen_tokens += verdict.chosen_overlap * verdict.seen.block_size
        if verdict.outcome is not Outcome.unknown and verdict.best:
            ratio = verdict.chosen_overlap / verdict.best
            totals.ratio_sum += ratio
            totals.ratio_count += 1
            for i, bound in enumerate(RATIO_BUCKETS):
                if ratio <= bound:
                    totals.ratio_buckets[i] += 1

    def _label(self, router: str) -> str:
        routers = self._routers
        if router in routers or router == "kvctl":
            return router
        if len(routers) < self._max_routers:
            routers.add(router)
            return router
        return OTHER

    def priced(self, since: float, model: str | None = None) -> list[Priced]:
        """The priced decisions heard at or after `since` (of `model` only, if given), oldest first."""
        return [p for p in self._priced if p.verdict.seen.at >= since
                and (model is None or p.verdict.seen.model == model)]

    def find(self, request_id: str) -> Verdict | None:
        return self._by_request.get(request_id)

    def window(self, since: float, model: str | None = None) -> list[Verdict]:
        """The verdicts heard at or after `since`, oldest first (of `model` only, if given)."""
        out = []
        for verdict in reversed(self._ring):
            if verdict.seen.at < since:
                break
            if model is None or verdict.seen.model == model:
                out.append(verdict)
        out.reverse()
        return out

    @property
    def capacity(self) -> int:
        return self._ring.maxlen or 0

    def __len__(self) -> int:
        return len(self._ring)


def summarise(verdicts: Iterable[Verdict]) -> dict[str, Any]:
    """A window's figures: the share of decisions that went to a worker holding the most cache, of those where
    some candidate held any (`cached_decisions`: with none, any pick is as good); avoidable prefill against what
    the best picks would have found cached; agreement with kvctl's cost function; the reasons ranked; per worker."""
    outcomes: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    agreement: Counter[str] = Counter()
    routers: Counter[str] = Counter()
    workers: dict[WorkerKey, Counter[str]] = {}
    avoidable = cacheable = no_overlap = 0
    for v in verdicts:
        no_overlap += v.why is Why.no_overlap
        outcomes[v.outcome.value] += 1
        agreement[v.agreement.value] += 1
        routers[v.seen.router] += 1
        if v.outcome is not Outcome.optimal:
            reasons[v.why.value] += 1
        row = workers.setdefault(v.seen.chosen, Counter())
        row["decisions"] += 1
        row[v.outcome.value] += 1
        row["avoidable_tokens"] += v.avoidable_tokens
        avoidable += v.avoidable_tokens
        if v.outcome is not Outcome.unknown:
            cacheable += v.cacheable_tokens
    cached = outcomes[Outcome.suboptimal.value] + outcomes[Outcome.optimal.value] - no_overlap
    compared = agreement[Agreement.agree.value] + agreement[Agreement.tie.value] + agreement[Agreement.disagree.value]
    return {
        "decisions": sum(outcomes.values()),
        "outcomes": {o.value: outcomes[o.value] for o in Outcome},
        "cached_decisions": cached,
        "optimal_share": (outcomes[Outcome.optimal.value] - no_overlap) / cached if cached else None,
        "avoidable_prefill_tokens": avoidable,
        "cacheable_prefill_tokens": cacheable,
        "avoidable_share": avoidable / cacheable if cacheable else None,
        "agreement": {a.value: agreement[a.value] for a in Agreement},
        "agreement_share": (agreement[Agreement.agree.value] + agreement[Agreement.tie.value]) / compared
        if compared else None,
        "reasons": dict(reasons.most_common()),
        "routers": dict(routers.most_common()),
        "workers": [{"worker_id": w[0], "dp_rank": w[1], **{k: c[k] for k in ("decisions", "optimal", "suboptimal",
                                                                                "unknown", "avoidable_tokens")}}
                    for w, c in sorted(workers.items())],
    }

