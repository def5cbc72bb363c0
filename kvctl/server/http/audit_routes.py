"""`GET /v1/audit` and `GET /v1/audit/{request_id}`: the decision audit's window summary and one decision explained;
`POST /v1/decisions`: a recording's decisions heard as replica sync hears them (docs/audit.md, docs/http-api.md)."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from kvctl import http_api as api
from kvctl.core.audit import Verdict, summarise
from kvctl.core.audit.what_if import parse_knobs, what_if
from kvctl.core.events.errors import DecodeError
from kvctl.core.events.plane import sequence_event_of
from kvctl.core.names import DEFAULT_MODEL, MAX_REQUEST_ID_CHARS, format_worker
from kvctl.errors import ApiError
from kvctl.server.budget import Slices
from kvctl.server.http.bodies import invalid, parse_events
from kvctl.server.plane.replica_sync import PeerBookings, PeerLimits, audit_heard
from kvctl.server.state import Fleet

if TYPE_CHECKING:
    from kvctl.server.http.metrics import Plane

MAX_WINDOW_S = 24 * 3600.0
MAX_RECENT = 1000
MAX_DECISIONS = 10_000
"""Decisions in one `POST /v1/decisions` body, at most: each add is audited (a walk of its blocks, ~0.1 ms at 10M
pairs), a slice of the loop at a time."""

Handler = Callable[[Request], Awaitable[Response]]


def audit_handlers(fleet: Fleet, clock: Callable[[], float], plane: Plane | None = None
                   ) -> dict[tuple[str, str], Handler]:
    """`plane`: the router's event plane, if any: a replayed decision is judged as one it brings would be (its own
    router id skipped, its workers' staleness named, booked beside its replica sync's bookings)."""
    bookings: dict[str, PeerBookings] = {}  # per model, where no plane books peers' requests
    async def audit(request: Request) -> Response:
        query = request.query_params
        window = _number(query.get("window", "300"), "window", MAX_WINDOW_S)
        recent = int(_number(query.get("recent", "0"), "recent", MAX_RECENT))
        model = query.get("model")
        if model is not None and model not in fleet.models:
            raise ApiError(f"unknown model {model!r}; the router serves {sorted(fleet.models) or 'none yet'}",
                           status=404)
        now = clock()
        fleet.audit.settle(now)  # decisions whose worker never registered: judged now, not at the next one
        ledger = fleet.audit.ledger
        verdicts = ledger.window(now - window, model)
        figures = summarise(verdicts)
        workers = [api.AuditWorker(**row) for row in figures.pop("workers")]
        knobs = _knobs(query.getlist("what_if"))
        body = api.Audit(window, model, ledger.seen, len(ledger), ledger.capacity, workers=workers,
                         looked_at=_looked_at(fleet, verdicts, window),
                         recent=[decision(v, now) for v in verdicts[-recent:]] if recent else [],
                         what_if=api.AuditWhatIf(**what_if(ledger.priced(now - window, model), knobs))
                         if knobs else None, waiting=fleet.audit.waiting,
                         totals=[api.AuditTotals(m, r, sum(t.decisions.values()), t.cacheable_tokens, t.chosen_tokens,
                                                 t.avoidable_tokens)
                                 for (m, r), t in sorted(ledger.totals.items()) if model is None or m == model],
                         **figures)
        return Response(msgspec.json.encode(body), media_type="application/json")

    async def one(request: Request) -> Response:
        request_id = request.path_params["request_id"]
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise invalid("path", "request_id", f"a request id is at most {MAX_REQUEST_ID_CHARS} characters, got "
                                                f"{len(request_id)}")
        verdict = fleet.audit.ledger.find(request_id)
        if verdict is None:
            raise ApiError(f"no decision for request {request_id!r} among the {len(fleet.audit.ledger)} the audit "
                           "remembers (the most recent ones: see GET /v1/audit?recent=N)", status=404)
        return Response(msgspec.json.encode(decision(verdict, clock())), media_type="application/json")

    async def decisions(request: Request) -> Response:
        """Other routers' decisions (serde JSON of `active_sequences_events`), in order: each add audited against
        the index as it is, then each booked, as replica sync takes them from a plane (`events replay` of a
        recording made with `--decisions`). `model`: that of a worker the router has not heard of."""
        model = request.query_params.get("model", DEFAULT_MODEL)
        fleet.model(model)  # a model the router serves (404 naming those it does)
        raw = await request.body()
        try:
            items = list(itertools.islice(parse_events(raw, request.headers.get("content-type", "")),
                                          MAX_DECISIONS + 1))
        except ValueError as exc:
            raise ApiError(str(exc), status=400) from None
        if len(items) > MAX_DECISIONS:
            raise invalid("body", None, f"at most {MAX_DECISIONS:,} decisions in one body: send them in batches")
        ingest = None if plane is None else plane.ingest
        peers = ingest.peers if ingest is not None and ingest.peers is not None else \
            bookings.setdefault(model, PeerBookings(fleet, model, PeerLimits()))
        audited, booked, rejected, slices = 0, Counter[str](), Counter[str](), Slices()
        for item in items:
            await slices.tick()
            try:
                event = sequence_event_of(item)
            except DecodeError as exc:
                rejected[exc.kind.value] += 1
                continue
            if ingest is not None and event.router_id == ingest.router_id:
                booked["own_sequence_events"] += 1
                continue
            now = clock()
            audited += audit_heard(fleet, event, model, ingest.stale if ingest is not None else dict, now)
            booked[peers.take(event, now)] += 1
        return Response(msgspec.json.encode(api.DecisionsHeard(len(items), audited, dict(booked), dict(rejected))),
                        media_type="application/json")

    return {("GET", "/v1/audit"): audit, ("GET", "/v1/audit/{request_id}"): one,
            ("POST", "/v1/decisions"): decisions}


def decision(verdict: Verdict, now: float) -> api.AuditedDecision:
    seen = verdict.seen
    return api.AuditedDecision(
        seen.request_id, seen.model, seen.router, max(0.0, now - seen.at), seen.chosen[0], seen.chosen[1],
        seen.role.value, seen.blocks, seen.resolved, verdict.outcome.value, verdict.why.value,
        verdict.agreement.value, verdict.best, verdict.chosen_overlap, verdict.avoidable_tokens,
        [format_worker(w) for w in verdict.optimal], [format_worker(w) for w in verdict.kvctl_picks],
        verdict.router_overlap, seen.unresolved, {format_worker(w): why for w, why in (seen.stale or {}).items()},
        [api.AuditRow(r.worker[0], r.worker[1], r.device, r.cached, r.weighted, r.logit, r.busy) for r in verdict.rows])


def _looked_at(fleet: Fleet, verdicts: list[Verdict], window: float) -> str:
    """What the window was drawn from: said most where it is empty, so an empty answer is never a silent one."""
    if verdicts:
        return f"{len(verdicts)} decisions heard in the last {window:g} s"
    heard = fleet.audit.ledger.seen
    return (f"no decision heard in the last {window:g} s ({heard} since start): the audit hears kvctl's own "
            "/v1/route picks and a Dynamo frontend's from its replica sync (start the frontend with "
            "--router-replica-sync and this router on the same event plane)")


def _knobs(items: list[str]) -> dict[str, float | bool]:
    """`what_if=KNOB=VALUE` items as knobs, each checked as a route's would be (422 naming a bad one)."""
    try:
        return parse_knobs(items)
    except ValueError as exc:
        raise invalid("query", "what_if", str(exc)) from None


def _number(text: str, name: str, most: float) -> float:
    try:
        value = float(text)
    except ValueError:
        raise invalid("query", name, f"{name} must be a number, got {text!r}") from None
    if not 0 <= value <= most:
        raise invalid("query", name, f"{name} must be in [0, {most:g}], got {text}")
    return value
