"""The decision audit's answers of `kvctl serve`'s HTTP API (docs/http-api.md, docs/audit.md): `kvctl.http_api`
names them with the rest; they live here because that module is at its size."""

from __future__ import annotations

from typing import Any

from msgspec import Struct


class AuditWorker(Struct):
    """One picked worker's decisions in an audit window."""

    worker_id: int
    dp_rank: int
    decisions: int
    optimal: int
    suboptimal: int
    unknown: int
    avoidable_tokens: int


class Audit(Struct):
    """`GET /v1/audit`: the decisions heard in the last `window_s` (of `model`, or all), judged against the index
    (docs/audit.md). `heard` counts every decision since start; `kept` of at most `capacity` are remembered.
    `optimal_share` is over the `cached_decisions`, those where some candidate held cache (with none, any pick is
    as good). Shares are null where nothing was judged; `looked_at` says what an empty window looked at."""

    window_s: float
    model: str | None
    heard: int
    kept: int
    capacity: int
    decisions: int
    outcomes: dict[str, int]
    cached_decisions: int
    optimal_share: float | None
    avoidable_prefill_tokens: int
    cacheable_prefill_tokens: int
    avoidable_share: float | None
    agreement: dict[str, int]
    agreement_share: float | None
    reasons: dict[str, int]
    routers: dict[str, int]
    workers: list[AuditWorker]
    looked_at: str
    recent: list[AuditedDecision] = []
    what_if: AuditWhatIf | None = None
    waiting: int = 0  # decisions for a worker kvctl has not heard of yet, judged when it registers (30 s at most)
    totals: list[AuditTotals] = []  # since this router started, per model and router: beside a router's own counters


class AuditTotals(Struct):
    """One (model, router) pair's decisions since this router started: the prompt tokens cached on the best
    candidates (Dynamo's "best eligible"), on the picks (its "selected") and their difference, the avoidable
    prefill, as kvctl's index had them."""

    model: str
    router: str
    decisions: int
    cacheable_prefill_tokens: int
    chosen_prefill_tokens: int
    avoidable_prefill_tokens: int


class AuditWhatIf(Struct):
    """The window's priced decisions (the last 1,024 kept with their cost inputs) priced again under `knobs` over
    each one's own: how many picks would change, and the optimal share and avoidable prefill then (a draw among
    equals at its expected value), beside the actual ones. Each decision stands as it was: what another pick would
    have changed later is not followed."""

    knobs: dict[str, Any]
    decisions: int
    changed: int
    optimal_share: float | None
    optimal_share_then: float | None
    avoidable_prefill_tokens: int
    avoidable_prefill_tokens_then: int


class AuditRow(Struct):
    """A candidate as the audit saw it: its overlap on the device tier, the prompt's blocks it holds on any tier
    (`cached_blocks`, what the outcome is judged on), the same weighted by tier, and its cost."""

    worker_id: int
    dp_rank: int
    overlap_blocks: int
    cached_blocks: int
    weighted_blocks: float
    logit: float
    busy: bool


class AuditedDecision(Struct):
    """`GET /v1/audit/{request_id}`: one recent decision as it was judged (`age_s` ago). `router`: "kvctl" or the
    Dynamo router id that published it; `router_overlap`: the overlap that router credited its pick with (from its
    prefill estimate; a lower bound within one block); `optimal` and `kvctl_picks` name workers as ID:DP."""

    request_id: str
    model: str
    router: str
    age_s: float
    worker_id: int
    dp_rank: int
    role: str
    blocks: int
    resolved_blocks: int
    outcome: str
    reason: str
    agreement: str
    best_overlap: int
    chosen_overlap: int
    avoidable_tokens: int
    optimal: list[str]
    kvctl_picks: list[str]
    router_overlap: float | None
    unresolved: str | None
    stale: dict[str, str]
    candidates: list[AuditRow]


class DecisionsHeard(Struct):
    """`POST /v1/decisions`: of the `heard` decisions, the adds `audited` (routed requests), what became of each as
    replica sync would book it (its counters: `peer_booked`, `peer_freed`, `peer_refused`, ...), and those
    `rejected` as malformed, by kind."""

    heard: int
    audited: int
    booked: dict[str, int]
    rejected: dict[str, int]
