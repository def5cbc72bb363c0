"""The HTTP API of `kvctl serve` (docs/http-api.md): thin handlers over `Fleet`, one place mapping errors to statuses.
Every body is a `kvctl.http_api` Struct, decoded and encoded by msgspec: integers over 2^53 (hashes, worker ids)
are read and written exactly, never through floats."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from kvctl import __version__
from kvctl import http_api as api
from kvctl.core import native
from kvctl.core.events import Tier
from kvctl.core.names import DEFAULT_MODEL, Role, format_worker, parse_worker
from kvctl.core.router.busy import THRESHOLD_FIELDS, AllBusy, ThresholdError, Thresholds
from kvctl.core.router.scoring import CREDITED_TIERS, Candidate, Decision
from kvctl.core.words import counted
from kvctl.errors import ApiError
from kvctl.server.http.audit_routes import audit_handlers
from kvctl.server.http.bodies import (
    OVERRIDES,
    Invalid,
    choice_param,
    decode_body,
    int_param,
    invalid,
    json_content_type,
    parse_events,
    read_route_body,
)
from kvctl.server.http.bulk import BulkLoads, decoded
from kvctl.server.http.dump_stream import dump_stream
from kvctl.server.http.metrics import HealthCollector, Metrics
from kvctl.server.http.openapi import OPERATIONS, document, pages
from kvctl.server.http.route_protocol import Connections, missing_internals, route_protocol
from kvctl.server.http.runbook_page import runbook_route
from kvctl.server.http.tree_stats import index_shape
from kvctl.server.http.worker_rows import worker_rows
from kvctl.server.ingest.endpoint import check_endpoint
from kvctl.server.ingest.streams import Streams
from kvctl.server.readiness import RETRY_AFTER_S, SAFE_METHODS, Readiness, ReadinessCollector
from kvctl.server.route_limits import OverLimit
from kvctl.server.state import Fleet, UnknownWorker
from kvctl.server.worker_info import WorkerInfo

if TYPE_CHECKING:
    from kvctl.server.http.metrics import Plane

log = logging.getLogger("kvctl.serve")
MAX_BODY_BYTES = 64 * 1024 * 1024
_dumps = msgspec.json.Encoder().encode
"""Compact JSON, ten times faster than the json module's; NaN and infinities (never in a reply) would be null."""


def _json(body: msgspec.Struct, status: int = 200) -> Response:
    return Response(_dumps(body), status_code=status, media_type="application/json")


def _error_bytes(status: int, message: str, **context: Any) -> tuple[int, bytes]:
    """An `api.Error`: the message, and the fields that give its context (`api.Error`'s optional ones)."""
    return status, _dumps(api.Error(message, **context))


def _error(status: int, message: str, **context: Any) -> Response:
    status, body = _error_bytes(status, message, **context)
    return Response(body, status_code=status, media_type="application/json")


def _thresholds(thresholds: Thresholds, model: str) -> api.Thresholds:
    return msgspec.convert(thresholds.as_dict(model), api.Thresholds)


_OPEN_MUTATIONS = (
    ("POST", re.compile(r"/v1/route")),
    ("POST", re.compile(r"/v1/requests/[^/]+/prefill_complete")),
    ("DELETE", re.compile(r"/v1/requests/[^/]+")),
)
"""The non-GET calls that never need the admin token: the request lifecycle (route, reserve, prefill complete,
free), which a request router calls on every request and which cannot change the index. Every other method but
GET/HEAD/OPTIONS needs the token when one is set, endpoints added later included (deny by default)."""


def _not_in_flight(fleet: Fleet, model: str, request_id: str) -> Response:
    """404, naming the model that has the request in flight when one does (a request booked on a card's model)."""
    held = next((m for m, state in sorted(fleet.models.items()) if state.router.sequences.get(request_id)), None)
    return _error(404, f"request {request_id!r} is not in flight in model {model!r}" + (
        f": it is in flight in model {held!r} (pass ?model={held})" if held else " (already freed?)"))


def _needs_admin(method: str, path: str) -> bool:
    return method not in SAFE_METHODS and not any(
        method == m and pattern.fullmatch(path) for m, pattern in _OPEN_MUTATIONS)


def _refusal(exc: Exception) -> tuple[int, bytes]:
    """(status, `api.Error` body) for the errors raised while answering a request."""
    if isinstance(exc, ApiError):  # the error tree's own (e.g. UnknownModel): it knows its status
        return _error_bytes(exc.status, exc.message, **exc.fields)
    if isinstance(exc, _BodyTooLarge):
        return _error_bytes(413, str(exc))
    if isinstance(exc, OverLimit):
        return _error_bytes(429, str(exc), limit=exc.limit, flag=exc.flag)
    if isinstance(exc, AllBusy):
        tripped = {format_worker(w): [str(r) for r in reasons] for w, reasons in sorted(exc.tripped.items())}
        return _error_bytes(503, str(exc), thresholds=_thresholds(exc.thresholds, exc.model), tripped=tripped)
    if isinstance(exc, Invalid):
        return 422, _dumps(api.Invalid(exc.fields))
    raise TypeError(f"no HTTP status for {type(exc).__name__}") from exc


class _Routing:
    """POST /v1/route, the hot path: bytes in, (status, JSON bytes) out, no framework in between."""

    def __init__(self, fleet: Fleet, metrics: Metrics, clock: Callable[[], float]) -> None:
        self.fleet, self.metrics, self.clock = fleet, metrics, clock
        # Each model's histogram children, looked up once: `labels()` takes a lock and builds a key per call.
        self._observers: dict[str, tuple[Callable[[float], None], Callable[[float], None]]] = {}
        self._unobserved: list[tuple[str, float, float | None]] = []  # (model, seconds, predicted hit rate)

    def _observers_of(self, model: str) -> tuple[Callable[[float], None], Callable[[float], None]]:
        observers = self._observers.get(model)
        if observers is None:  # only models that routed get here: an unknown one was refused before
            observers = self._observers[model] = (self.metrics.route_seconds.labels(model).observe,
                                                  self.metrics.predicted_hit.labels(model).observe)
        return observers

    def observe(self) -> None:
        """Record the routes answered since the last call in the metrics: called once their answers are
        written, so that the client does not wait on it (two histogram updates, each taking a lock), and
        before the metrics are read."""
        unobserved, self._unobserved = self._unobserved, []
        for model, seconds, hit in unobserved:
            route_seconds, predicted_hit = self._observers_of(model)
            route_seconds(seconds)
            if hit is not None:
                predicted_hit(hit)

    def reply(self, raw: bytes) -> tuple[int, bytes]:
        try:
            body, token_ids = read_route_body(raw)
        # ValidationError included: it says which field. Bad UTF-8 inside a JSON string raises UnicodeDecodeError,
        # and a bad token id ValueError; both are as undecodable as any malformed body, so the same 422.
        except (msgspec.DecodeError, ValueError) as exc:
            return _error_bytes(422, f"invalid route request: {exc}")
        if body.local_hashes and max(body.local_hashes) > 2**64 - 1:
            return _error_bytes(422, "local_hashes must be u64 (< 2^64)")
        if (token_ids is None) == (body.local_hashes is None) or (body.cache_salt and token_ids is None):
            return _error_bytes(400, "give exactly one of token_ids and local_hashes" if body.cache_salt is None
                                else "cache_salt goes with token_ids: local_hashes are hashed already")
        if body.reserve and not body.request_id:
            return _error_bytes(400, "reserve needs a request_id")
        started = time.perf_counter()
        overrides = {name: value for name in OVERRIDES if (value := getattr(body, name)) is not None}
        try:
            decision = self.fleet.route(
                body.model, now=self.clock(), token_ids=token_ids, local_hashes=body.local_hashes, reserve=body.reserve,
                lora_name=body.lora_name, cache_salt=body.cache_salt, request_id=body.request_id, overrides=overrides,
                session_id=body.session_id)
        except (ApiError, OverLimit, AllBusy) as exc:
            return _refusal(exc)
        except ValueError as exc:  # BadKnob (a number too large for a float passes msgspec), or local_hashes where
            return _error_bytes(422, f"invalid route request: {exc}")  # keyed tracking needs token ids
        self._unobserved.append((body.model, time.perf_counter() - started, min(
            1.0, decision.overlap_blocks / decision.required_blocks) if decision.required_blocks else None))
        return 200, _dumps(_decision(decision, body.request_id, body.explain))


def _decision(decision: Decision, request_id: str | None, explain: bool) -> api.Decision:
    out = api.Decision(decision.worker[0], decision.worker[1], decision.overlap_blocks, decision.required_blocks,
                       request_id, decision.reason.value)
    if explain:
        out.candidates = [_candidate(c) for c in decision.candidates]
    if decision.role is not Role.aggregated:
        out.role = decision.role.value
    if decision.decode is not None:
        out.decode = _decision(decision.decode, request_id, explain)
    if (verdict := decision.queued) is not None:
        c = verdict.policy_class
        out.queued = api.Queued(c.queue_policy.value, c.prefill_busy_threshold_frac, {format_worker(w): str(reason)
                                for w, reason in verdict.over.items()}, c.name, c.prefill_busy_threshold)
    return out


def _candidate(row: Candidate) -> api.Candidate:
    """An explained decision's row as the API writes it: every tier named, even one with nothing in it."""
    return api.Candidate(
        row.worker[0], row.worker[1], row.overlap_blocks,
        {tier.value: row.overlap_by_tier.get(tier, 0) for tier in Tier},
        {tier.value: row.credit_by_tier.get(tier, 0.0) for tier in CREDITED_TIERS}, row.credit, row.decay,
        row.effective_overlap, row.tree_size, row.raw_prefill_blocks, row.prefill_blocks, row.decode_blocks,
        row.active_requests, row.logit, row.busy)


class _Front:
    """The outermost ASGI layer: body size cap, admin token, and POST /v1/route answered directly.

    Plain ASGI because every framework layer costs on every request: a framework's middleware stack and
    request handling were a third of a route's server time. Bodies announced too large are refused from
    their Content-Length; bodies sent without one (chunked) are counted as they arrive and cut off at the
    cap.
    """

    def __init__(self, app: ASGIApp, routing: _Routing, readiness: Readiness, *, admin_token: str | None,
                 max_body_bytes: int) -> None:
        self.app = app
        self.routing = routing
        self.readiness = readiness
        self.expected = f"Bearer {admin_token}".encode() if admin_token else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await _send(send, *_error_bytes(413, f"body of {int(length)} bytes is over the "
                                                 f"{self.max_body_bytes}-byte limit"))
            return
        if (self.expected is not None and _needs_admin(scope["method"], scope["path"])
                and not hmac.compare_digest(headers.get(b"authorization", b""), self.expected)):
            sent = b"authorization" in headers  # a wrong token and a missing one have different fixes
            await _send(send, *_error_bytes(401, "the admin token sent is not this router's" if sent else
                                            "this endpoint needs the admin token: Authorization: Bearer <token>"))
            return
        if self.readiness.refuses(scope["method"], scope["path"]):
            await _send(send, 503, _dumps(self.readiness.refusal()), _RETRY_AFTER)
            return
        if not self.readiness.ready:
            send = self.readiness.warned(send)
        if scope["method"] == "POST" and scope["path"] == "/v1/route":
            try:
                raw = await self._body(receive)
            except _BodyTooLarge as exc:
                await _send(send, *_error_bytes(413, str(exc)))
                return
            await _send(send, *self.routing.reply(raw))
            self.routing.observe()
            return
        if b"content-length" not in headers and b"transfer-encoding" in headers:
            # Read here, before the app: a body sent without its length and over the cap is refused (413) like
            # one announced too large, whatever the handler would have answered without reading it.
            try:
                raw = await self._body(receive)
            except _BodyTooLarge as exc:
                await _send(send, *_error_bytes(413, str(exc)))
                return
            receive = _replay(raw, receive)
        await self.app(scope, self._capped(receive), send)

    async def _body(self, receive: Any) -> bytes:
        read = self._capped(receive)
        chunks: list[bytes] = []
        while True:
            message = await read()
            if message["type"] != "http.request":
                return b"".join(chunks)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _capped(self, receive: Any) -> Any:
        seen = 0

        async def capped() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise _BodyTooLarge(self.max_body_bytes)
            return message

        return capped


_JSON_HEADERS = [(b"content-type", b"application/json")]
_RETRY_AFTER = [(b"retry-after", str(RETRY_AFTER_S).encode())]


async def _send(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*_JSON_HEADERS, (b"content-length", str(len(body)).encode()), *(headers or ())]})
    await send({"type": "http.response.body", "body": body})


def _replay(body: bytes, receive: Any) -> Any:
    """A receive that gives the body already read, then whatever the connection says next (a disconnect)."""
    given = False

    async def replay() -> Any:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


class _BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"body over the {limit}-byte limit")
        self.limit = limit


def http_protocol(app: ASGIApp, *, fast_path: bool = True) -> type[asyncio.Protocol] | Literal["h11"]:
    """The uvicorn HTTP protocol to serve `app` (from `create_app`) with: plain routes answered in it unless
    `fast_path` is False. "h11" (uvicorn's pure-Python one, every request through the app, no connection limits
    of ours) where the installed uvicorn lacks what ours needs: a uvicorn upgrade must not stop the router, nor
    leave a request head unbounded, as uvicorn's httptools protocol does (h11 bounds it: `h11_limits`)."""
    assert isinstance(app, _Front)
    missing = missing_internals()
    if missing is not None:
        log.warning("uvicorn %s lacks %s: serving with its h11 HTTP protocol, every route through the app "
                    "(slower), --idle-timeout as its keep-alive timeout, --max-connections as its concurrency "
                    "limit and --max-head-bytes as its head limit (a 400, not counted), no --head-timeout",
                    uvicorn.__version__, missing)
        return "h11"
    metrics = app.routing.metrics
    return route_protocol(app.routing.reply, app.routing.observe, app.max_body_bytes, metrics.connections,
                          app.routing.fleet.health, fast_path=fast_path, readiness=app.readiness)


def h11_limits(connections: Connections) -> dict[str, Any]:
    """uvicorn's own settings nearest to `connections`' limits, for its h11 protocol (`http_protocol`'s fallback).
    Its concurrency limit counts the asking connection too, so `max` open may still be answered."""
    return {"timeout_keep_alive": connections.idle_timeout_s, "limit_concurrency": connections.max + 1,
            "h11_max_incomplete_event_size": connections.max_head_bytes}


def loop_lag_observer(app: ASGIApp) -> Callable[[float], None]:
    """Where the daemon's loop probe (`daemon.watch_loop`) records how late it woke."""
    assert isinstance(app, _Front)
    return app.routing.metrics.loop_lag.observe


def metrics_registry(app: ASGIApp) -> CollectorRegistry:
    """Where parts the daemon starts (the state log) add their own collectors."""
    assert isinstance(app, _Front)
    return app.routing.metrics.registry


def create_app(fleet: Fleet, *, clock: Callable[[], float] = time.monotonic, admin_token: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, streams: Streams | None = None,
               plane: Plane | None = None, readiness: Readiness | None = None,
               connections: Connections | None = None) -> ASGIApp:
    """The router's ASGI app. `streams`: engine subscriptions to start and stop with worker registration
    (None: HTTP events only). `readiness`: the restore's progress, then which snapshot it restored and why
    (shown in status; None: nothing to restore). `connections`: the limits its `http_protocol` keeps."""
    readiness = readiness if readiness is not None else Readiness(restoring=False, clock=clock)
    metrics = Metrics(fleet, streams, plane, connections)
    metrics.registry.register(ReadinessCollector(readiness))
    metrics.registry.register(HealthCollector(fleet.health))
    routing = _Routing(fleet, metrics, clock)
    bulk = BulkLoads(fleet, clock)
    started = clock()

    async def prometheus(_: Request) -> Response:
        routing.observe()  # normally done already, once each answer was written
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def status(_: Request) -> Response:
        return _json(api.Status(
            version=__version__, native_speedups=native.IMPLEMENTATION, uptime_s=round(clock() - started, 3),
            rss_bytes=rss_bytes(), models=fleet.stats().models,
            streams=streams.status() if streams is not None else [],
            queues=streams.queues() if streams is not None else [],
            engines=streams.engines() if streams is not None else None,
            decoder=streams.decoder.status() if streams is not None else None,
            event_plane=plane.status() if plane is not None else None, restore=readiness.restored,
            connections=api.ConnectionStats(**dataclasses.asdict(metrics.connections)),
            loop=api.LoopHeld(**metrics.loop_lag.status()),
            limits=api.Limits(**dataclasses.asdict(fleet.limits), refused=dict(fleet.over_limit)),
            readiness=readiness.answer(fleet.health), health=fleet.health.answer(), modes=api.RoutingModes(
                None if (q := fleet.queues) is None else q.status(),
                None if (book := fleet.sessions) is None else {"ttl_s": book.ttl_s, "sessions": len(book),
                                                                 "evicted": book.evicted})))

    async def healthz(_: Request) -> Response:
        return _json(api.Health("ok", __version__))

    async def readyz(_: Request) -> Response:
        """Readiness, apart from liveness: a restart restoring a large index, or a router blind to a model (its
        event plane down), is alive but must get no routes."""
        answer = readiness.answer(fleet.health)
        ready = answer.status in ("ready", "partial")
        headers = None if ready else {"retry-after": str(RETRY_AFTER_S)}
        return Response(_dumps(answer), status_code=200 if ready else 503, media_type="application/json",
                        headers=headers)

    async def list_workers(_: Request) -> Response:
        return _json(api.Workers(worker_rows(fleet, clock(), streams, plane)))

    async def register_worker(request: Request) -> Response:
        body = decode_body(await request.body(), api.WorkerBody)
        for name in ("endpoint", "replay_endpoint"):
            if (endpoint := getattr(body, name)) is not None:
                try:
                    check_endpoint(endpoint)
                except ValueError as exc:
                    raise invalid("body", name, str(exc)) from None
        info = WorkerInfo(body.worker_id, body.dp_rank, body.model, body.endpoint, body.replay_endpoint, body.topic,
                          total_blocks=body.total_blocks)
        if streams is not None and streams.max_engines is not None and not streams.admit(info):  # refused now
            return _error(409, f"this router follows {counted(streams.max_engines, 'engine endpoint')} already, its "
                               "most "
                               "(serve --max-engines, whose default the file limit sets: ulimit -n); remove "
                               "one (DELETE /v1/workers/ID) or raise the limit")
        info = fleet.register(info)
        if streams is not None:
            streams.start(info)
        row = next(r for r in worker_rows(fleet, clock(), streams, plane) if (r.worker_id, r.dp_rank) == info.key)
        return _json(row, 201)

    async def remove_worker(request: Request) -> Response:
        worker_id = int_param(request.path_params["worker_id"], "path", "worker_id")
        dp_rank = int_param(request.query_params.get("dp_rank"), "query", "dp_rank")
        try:
            fleet.check_worker(worker_id, dp_rank)
            stopped = await streams.stop(worker_id, dp_rank) if streams is not None else None
            removed = fleet.unregister(worker_id, dp_rank)  # after the streams' last batches are in
            if stopped is not None:
                removed.streams_stopped = stopped
            return _json(removed)
        except UnknownWorker:
            return _error(404, f"unknown worker {worker_id}" + ("" if dp_rank is None else f":{dp_rank}"))

    async def post_events(request: Request) -> Response:
        model = request.query_params.get("model", DEFAULT_MODEL)
        if fleet.approx is not None:
            return _error(409, "this router runs in approximate mode: it indexes its own routing decisions, "
                               "not KV events (restart without --approximate to accept them)")
        fleet.model(model)  # models come from the configuration or a worker's registration, never from events
        raw = await request.body()
        try:  # all of it decoded before any is applied: a body that is not JSON changes nothing
            events, rejected = await decoded(parse_events(raw, request.headers.get("content-type", "")))
        except ValueError as exc:
            return _error(400, str(exc))
        applied, statuses = await bulk.apply(model, events)
        return _json(api.EventsApplied(applied, dict(rejected + statuses)))

    async def prefill_complete(request: Request) -> Response:
        request_id, model = request.path_params["request_id"], request.query_params.get("model", DEFAULT_MODEL)
        raw = await request.body()
        body = None if raw.strip() in (b"", b"null") else decode_body(raw, api.PrefillBody)
        if not fleet.prefill_complete(model, request_id, None if body is None else body.cached_tokens):
            return _not_in_flight(fleet, model, request_id)
        return _json(api.PrefillCompleted(request_id))

    async def free_request(request: Request) -> Response:
        request_id, model = request.path_params["request_id"], request.query_params.get("model", DEFAULT_MODEL)
        if not fleet.free(model, request_id):
            return _not_in_flight(fleet, model, request_id)
        return _json(api.Freed(request_id))

    async def tree(request: Request) -> Response:
        query = request.query_params
        jsonl = choice_param(query.get("format", "json"), "format", ("json", "jsonl")) == "jsonl"
        worker = query.get("worker")
        try:
            wanted = parse_worker(worker) if worker is not None else None
        except ValueError as exc:
            return _error(400, str(exc))
        index = fleet.model(query.get("model", DEFAULT_MODEL)).router.index
        return StreamingResponse(dump_stream(index, wanted, jsonl),
                                 media_type="application/x-ndjson" if jsonl else "application/json")

    async def tree_stats(request: Request) -> Response:
        query = request.query_params
        stats = fleet.stats(query.get("model"))
        top = int_param(query.get("top", "10"), "query", "top")
        if top < 0:
            raise invalid("query", "top", f"top must be >= 0, got {top}")
        if choice_param(query.get("shape", "false"), "shape", ("true", "false")) == "true":
            for name, entry in stats.models.items():  # walked in slices: see server.tree_stats
                shape = await index_shape(fleet.model(name).router.index, top=top)
                entry.paths, entry.depths, entry.shared_prefixes = (
                    shape["paths"], shape["depths"], shape["shared_prefixes"])
        return _json(stats)

    async def reset(request: Request) -> Response:
        body = decode_body(await request.body(), api.ResetBody)
        return _json(fleet.reset(body.model, body.worker_id, body.dp_rank))

    async def get_thresholds(_: Request) -> Response:
        models = sorted(set(fleet.models) | set(fleet.thresholds.all()))
        return _json(api.ThresholdsList([_thresholds(fleet.thresholds.get(m), m) for m in models]))

    async def post_thresholds(request: Request) -> Response:
        """Set a model's busy thresholds, as Dynamo's frontend does: 415 without a JSON content type, 400 for a
        body that is not JSON, 422 for JSON of the wrong shape (a negative token threshold included)."""
        # The statuses and messages are those of axum's Json extractor, which Dynamo's frontend uses.
        if not json_content_type(request.headers.get("content-type", "")):
            return _error(415, "Expected request with `Content-Type: application/json`")
        try:  # JSON first, then its shape: a body that is not JSON is a 400 whatever it holds
            data = msgspec.json.decode(await request.body())
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:  # serde_json refuses deep
            return _error(400, f"Failed to parse the request body as JSON: {exc}")  # nesting and bad UTF-8 alike
        try:
            body = msgspec.convert(data, api.BusyBody)
        except msgspec.ValidationError as exc:
            return _error(422, f"Failed to deserialize the JSON body into the target type: {exc}")
        fields = {name: getattr(body, name) for name in THRESHOLD_FIELDS}
        setting = any(v is not None for v in fields.values())
        if setting and body.model not in fleet.models:
            return _error(404, f"Model '{body.model}' not found. Thresholds can only be set for discovered models.",
                          models=sorted(fleet.models))
        try:
            thresholds = fleet.thresholds.apply_request(body.model, fields)
        except ThresholdError as exc:
            return _error(400, str(exc))
        return _json(_thresholds(thresholds, body.model))

    async def unset_thresholds(request: Request) -> Response:
        """Turn a model's thresholds off: those named by `field`, else all of them. Not in Dynamo's API, whose
        POST can only set a threshold."""
        model = request.query_params.get("model")
        if model is None:
            raise invalid("query", "model", "the model is required: ?model=NAME", "missing")
        try:
            thresholds = fleet.thresholds.unset(model, *(request.query_params.getlist("field") or THRESHOLD_FIELDS))
        except ThresholdError as exc:
            return _error(400, str(exc))
        return _json(_thresholds(thresholds, model))

    handlers: dict[tuple[str, str], Callable[[Request], Awaitable[Response]]] = {
        ("GET", "/metrics"): prometheus, ("GET", "/v1/status"): status, ("GET", "/healthz"): healthz,
        ("GET", "/readyz"): readyz,
        ("GET", "/v1/workers"): list_workers, ("POST", "/v1/workers"): register_worker,
        ("DELETE", "/v1/workers/{worker_id}"): remove_worker, ("POST", "/v1/events"): post_events,
        ("POST", "/v1/requests/{request_id}/prefill_complete"): prefill_complete,
        ("DELETE", "/v1/requests/{request_id}"): free_request, ("GET", "/v1/tree"): tree,
        ("GET", "/v1/tree/stats"): tree_stats, ("POST", "/v1/reset"): reset,
        ("GET", "/busy_threshold"): get_thresholds, ("POST", "/busy_threshold"): post_thresholds,
        ("DELETE", "/busy_threshold"): unset_thresholds, **audit_handlers(fleet, clock, plane),
    }
    # POST /v1/route is answered by `_Front`, ahead of the app, on either path (`http_protocol`).
    assert {*handlers, ("POST", "/v1/route")} == {(op.method, op.path) for op in OPERATIONS}, "the routes and the " \
        "table of the document disagree"
    refusals = dict.fromkeys((_BodyTooLarge, ApiError, OverLimit, AllBusy, Invalid), _refuse)
    app = Starlette(routes=[Route(path, handler, methods=[method]) for (method, path), handler in handlers.items()]
                    + pages(openapi_document) + [runbook_route()],
                    exception_handlers={**refusals, HTTPException: _no_route})
    return _Front(app, routing, readiness, admin_token=admin_token, max_body_bytes=max_body_bytes)


def openapi_document() -> dict[str, Any]:
    """What `/openapi.json` serves."""
    return document(_needs_admin)


async def _refuse(_: Request, exc: Exception) -> Response:
    status, body = _refusal(exc)
    return Response(body, status_code=status, media_type="application/json")


async def _no_route(request: Request, exc: Exception) -> Response:
    """404 for a path the router does not have, 405 for a method it does not answer there."""
    assert isinstance(exc, HTTPException)
    status, body = _error_bytes(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}; the routes "
                                                 "are listed in GET /openapi.json")
    return Response(body, status_code=status, media_type="application/json", headers=exc.headers)


__all__ = ["create_app"]


def rss_bytes() -> int | None:
    """This process's resident memory now (Linux's /proc; None elsewhere): what the index costs, live."""
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")

