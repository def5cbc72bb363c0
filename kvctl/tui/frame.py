"""One screenful of `kvctl top`, computed from polls with no Textual and no clock: what the widgets draw,
what `--once` prints, and what the tests assert on.

A `FrameBuilder` keeps the previous poll, so rates are counter increases over the time between two polls
(a counter that went down means the router restarted: it counted from 0 again), and a short history of
them for the sparklines.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any

from kvctl.core.names import WorkerKey, format_worker
from kvctl.core.silence import is_silent
from kvctl.core.tiers import counter_increase, ratio
from kvctl.output.words import stream_state
from kvctl.tui.poll import EVENTS, PREDICTED_COUNT, PREDICTED_SUM, ROUTES, Poll, TierRate

HISTORY = 60
"""Polls kept for the sparklines: a minute at the default interval."""


class Mark(StrEnum):
    """Why a worker row is highlighted; a row can carry several."""

    busy = "busy"
    gapped = "gapped"
    silent = "silent"


@dataclass(frozen=True, slots=True)
class WorkerRow:
    worker_id: int
    dp_rank: int
    model: str
    blocks: int
    active_decode_blocks: int
    active_prefill_tokens: int
    busy: bool
    last_event_age_s: float | None
    gaps: int | None  # None: no engine stream (events come over HTTP or NATS)
    decode_errors: int | None
    route_share: float | None  # of the routes decided since the previous poll; None: unknown
    queued: int | None  # requests waiting at the worker, from its last forward pass (Dynamo); None: no report
    marks: tuple[Mark, ...]
    role: str | None  # from its model card: aggregated, prefill or decode; None: no card
    raw: dict[str, Any] = field(compare=False)  # the worker's /v1/workers row, and its stream row under "stream"

    @property
    def key(self) -> str:
        return format_worker((self.worker_id, self.dp_rank))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.key, "worker_id": self.worker_id, "dp_rank": self.dp_rank, "model": self.model,
                "blocks": self.blocks, "active_decode_blocks": self.active_decode_blocks,
                "active_prefill_tokens": self.active_prefill_tokens, "busy": self.busy,
                "last_event_age_s": self.last_event_age_s, "gaps": self.gaps, "decode_errors": self.decode_errors,
                "route_share": self.route_share, "queued": self.queued, "marks": [m.value for m in self.marks],
                "role": self.role}


@dataclass(frozen=True, slots=True)
class Header:
    models: tuple[str, ...]
    uptime_s: float | None
    events_per_s: float | None
    routes_per_s: float | None
    predicted_hit_rate: float | None
    blocks: int
    nodes: int
    rss_bytes: int | None
    restoring: str | None = None  # how far a restart's restore is, until the index is whole (its counts are part)


@dataclass(frozen=True, slots=True)
class StreamHealth:
    """The engine streams summed up, and the event plane's connection if the router has one."""

    streams: int
    by_state: dict[str, int]
    gaps: int
    lost_batches: int
    replays_failed: int
    restarts: int
    decode_errors: int
    dropped_batches: int
    plane: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class RoutingAudit:
    """The router's decision audit over its last `window_s` (`GET /v1/audit`, docs/audit.md): the figures the
    audit line shows. `optimal_share` is over the `cached_decisions` (those with cache to find); shares are None
    where nothing was judged; `looked_at` says what an empty window looked at."""

    window_s: float
    decisions: int
    cached_decisions: int
    optimal_share: float | None
    avoidable_prefill_tokens: int
    cacheable_prefill_tokens: int
    avoidable_share: float | None
    agreement: dict[str, int]
    agreement_share: float | None
    reasons: dict[str, int]  # the non-optimal decisions by reason, most common first
    looked_at: str

    @classmethod
    def of(cls, answer: dict[str, Any]) -> RoutingAudit:
        """From the router's answer (its other keys: `kvctl audit`'s)."""
        return cls(**{f.name: answer[f.name] for f in fields(cls)})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Frame:
    router: str
    header: Header
    workers: tuple[WorkerRow, ...]
    health: StreamHealth
    tiers: tuple[TierRate, ...] | None
    tiers_error: str | None
    history: dict[str, tuple[float, ...]]  # events_per_s / routes_per_s / predicted_hit_rate, oldest first
    tiers_note: str | None = None  # instances without tier counters (docs/contract.md), said once
    audit: RoutingAudit | None = None
    audit_note: str | None = None  # why there is no audit (a router without one); neither: not polled

    def to_dict(self) -> dict[str, Any]:
        """The frame as `-o json` prints it: rates and rows, not the raw answers (record those with --record)."""
        h = self.header
        return {
            "router": self.router, "models": list(h.models), "uptime_s": h.uptime_s,
            "events_per_s": h.events_per_s, "routes_per_s": h.routes_per_s,
            "predicted_hit_rate": h.predicted_hit_rate, "blocks": h.blocks, "nodes": h.nodes,
            "rss_bytes": h.rss_bytes, "restoring": h.restoring, "workers": [w.to_dict() for w in self.workers],
            "streams": {"count": self.health.streams, "by_state": self.health.by_state, "gaps": self.health.gaps,
                        "lost_batches": self.health.lost_batches, "replays_failed": self.health.replays_failed,
                        "restarts": self.health.restarts, "decode_errors": self.health.decode_errors,
                        "dropped_batches": self.health.dropped_batches, "event_plane": self.health.plane},
            "tiers": None if self.tiers is None else [
                {"instance": t.instance, "tier": t.tier, "hit_rate": t.hit_rate, "family": t.family}
                for t in self.tiers],
            "tiers_error": self.tiers_error,
            "tiers_note": self.tiers_note,
            "audit": None if self.audit is None else self.audit.to_dict(),
            "audit_note": self.audit_note,
        }


def _rate(before: float | None, after: float | None, seconds: float) -> float | None:
    if before is None or after is None or seconds <= 0:
        return None
    return counter_increase(before, after) / seconds


def _marks(worker: dict[str, Any], stream: dict[str, Any] | None) -> tuple[Mark, ...]:
    age = worker.get("last_event_age_s")
    marks = []
    if worker.get("busy"):
        marks.append(Mark.busy)
    if stream is not None and (stream.get("gapped") or stream.get("lost_batches")):
        marks.append(Mark.gapped)
    # The doctor's rule: an engine that stopped publishing looks idle in every other column. One whose model card
    # says it publishes no KV events (a disaggregated fleet's decode worker) is silent by design, not marked.
    if is_silent(age) and worker.get("publishes_kv_events") is not False:
        marks.append(Mark.silent)
    return tuple(marks)


def _shares(before: Poll | None, after: Poll) -> dict[WorkerKey, float]:
    """Each worker's share of the routes decided between two polls, from a cumulative per-worker `routes`
    count when the router gives one (`kvctl serve` does not yet: every share is then unknown)."""
    if before is None:
        return {}
    prior = {(w["worker_id"], w["dp_rank"]): w.get("routes") for w in before.workers}
    won = {}
    for w in after.workers:
        key = (w["worker_id"], w["dp_rank"])
        routes_before = prior.get(key)
        if w.get("routes") is not None and routes_before is not None:
            won[key] = counter_increase(routes_before, w["routes"])
    total = sum(won.values())
    return {key: n / total for key, n in won.items()} if total else {}


def _workers(before: Poll | None, after: Poll) -> tuple[WorkerRow, ...]:
    streams = {(s["worker"]["worker_id"], s["worker"]["dp_rank"]): s for s in after.status.get("streams") or ()}
    shares = _shares(before, after)
    rows = []
    for w in after.workers:
        key = (w["worker_id"], w["dp_rank"])
        stream = streams.get(key)
        rows.append(WorkerRow(
            worker_id=w["worker_id"], dp_rank=w["dp_rank"], model=w["model"], blocks=w["blocks"],
            active_decode_blocks=w["active_decode_blocks"], active_prefill_tokens=w["active_prefill_tokens"],
            busy=bool(w["busy"]), last_event_age_s=w.get("last_event_age_s"),
            gaps=None if stream is None else stream["gaps"],
            decode_errors=None if stream is None else sum((stream.get("decode_errors") or {}).values()),
            route_share=shares.get(key), queued=_queued(w.get("forward_pass")), marks=_marks(w, stream),
            role=w.get("role"), raw={**w, "stream": stream}))
    return tuple(rows)


def _queued(passed: dict[str, Any] | None) -> int | None:
    return None if not passed else passed["queued_prefill_requests"] + passed["queued_decode_requests"]


def _health(status: dict[str, Any]) -> StreamHealth:
    streams = status.get("streams") or []
    by_state: dict[str, int] = {}
    for s in streams:
        state = stream_state(s)
        by_state[state] = by_state.get(state, 0) + 1

    def total(name: str) -> int:
        return sum(s.get(name) or 0 for s in streams)

    return StreamHealth(
        streams=len(streams), by_state=by_state, gaps=total("gaps"), lost_batches=total("lost_batches"),
        replays_failed=total("replays_failed"), restarts=total("restarts"),
        decode_errors=sum(sum((s.get("decode_errors") or {}).values()) for s in streams),
        dropped_batches=sum(q.get("dropped_batches") or 0 for q in status.get("queues") or ()),
        plane=status.get("event_plane"))


class FrameBuilder:
    """Polls in, frames out; remembers the previous poll (for rates) and the recent rates (for sparklines)."""

    def __init__(self, router: str, *, history: int = HISTORY) -> None:
        self.router = router
        self._previous: Poll | None = None
        self._history: dict[str, deque[float]] = {
            name: deque(maxlen=history) for name in ("events_per_s", "routes_per_s", "predicted_hit_rate")}

    def update(self, poll: Poll) -> Frame:
        before = self._previous
        seconds = poll.at - before.at if before is not None else 0.0

        def rate(name: str) -> float | None:
            return _rate(before.counters.get(name) if before else None, poll.counters.get(name), seconds)

        predicted = None
        if before is not None:
            counted = rate(PREDICTED_COUNT)
            summed = rate(PREDICTED_SUM)
            predicted = ratio(summed, counted) if counted is not None and summed is not None else None
        models = poll.status.get("models") or {}
        header = Header(
            models=tuple(sorted(models)), uptime_s=poll.status.get("uptime_s"),
            events_per_s=rate(EVENTS), routes_per_s=rate(ROUTES), predicted_hit_rate=predicted,
            blocks=sum(m["blocks"] for m in models.values()), nodes=sum(m["nodes"] for m in models.values()),
            rss_bytes=poll.status.get("rss_bytes"), restoring=_restoring(poll.status.get("readiness")))
        for name, value in (("events_per_s", header.events_per_s), ("routes_per_s", header.routes_per_s),
                            ("predicted_hit_rate", header.predicted_hit_rate)):
            if value is not None:
                self._history[name].append(value)
        self._previous = poll
        return Frame(router=self.router, header=header, workers=_workers(before, poll), health=_health(poll.status),
                     tiers=poll.tiers, tiers_error=poll.tiers_error, tiers_note=poll.tiers_note,
                     audit=None if poll.audit is None else RoutingAudit.of(poll.audit), audit_note=poll.audit_note,
                     history={name: tuple(values) for name, values in self._history.items()})


def _restoring(readiness: dict[str, Any] | None) -> str | None:
    """"phase, N%" while the router restores its index (a router without /readyz reports no readiness)."""
    if not readiness or readiness.get("status") != "restoring":
        return None
    return f"{readiness.get('phase')}, {readiness.get('percent')}%"


# ----- sorting and filtering the workers table -------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Sort:
    label: str
    field: str | None  # a WorkerRow attribute, largest first; None: by worker id
    reverse: bool = True


SORTS = (
    Sort("worker", None, reverse=False),
    Sort("blocks", "blocks"),
    Sort("active decode blocks", "active_decode_blocks"),
    Sort("prefill tokens", "active_prefill_tokens"),
    Sort("last event", "last_event_age_s"),
    Sort("share of routes", "route_share"),
)


def next_sort(current: Sort) -> Sort:
    return SORTS[(SORTS.index(current) + 1) % len(SORTS)]


def arrange(rows: Iterable[WorkerRow], sort: Sort, text: str = "") -> list[WorkerRow]:
    """The rows `text` finds (in the worker name, the model or a mark, case-insensitively), in `sort` order;
    ties and unknown values keep worker order, unknown values last."""
    needle = text.strip().lower()
    chosen = [r for r in rows if not needle or needle in r.key or needle in r.model.lower()
              or any(needle in m for m in r.marks)]
    chosen.sort(key=lambda r: (r.worker_id, r.dp_rank))
    if sort.field is None:
        return chosen
    attribute = sort.field
    known = [r for r in chosen if getattr(r, attribute) is not None]
    known.sort(key=lambda r: getattr(r, attribute), reverse=sort.reverse)  # stable: ties stay in worker order
    return known + [r for r in chosen if getattr(r, attribute) is None]
