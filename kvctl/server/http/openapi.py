"""`/openapi.json`, generated: the bodies' schemas from `kvctl.http_api`'s Structs, and one table (`OPERATIONS`) of
the routes, their parameters, their answers and the error statuses each can give.

What the outer layer answers for every operation is added from the table too: 401 where the admin token is
needed, 413 where a body can be sent. A client generated from the document, or schemathesis, then meets no status
and no body it was not told about.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvctl import __version__
from kvctl import http_api as api
from kvctl.core.events import Tier
from kvctl.core.names import DEFAULT_MODEL, MAX_REQUEST_ID_CHARS

_REF = "#/components/schemas/{name}"
_U64 = {"type": "integer", "minimum": 0, "maximum": 2**64 - 1}
_U32 = {"type": "integer", "minimum": 0, "maximum": 2**32 - 1}


def ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(name=name)}


_ROUTER_EVENT: dict[str, Any] = {
    "title": "RouterEvent",
    "description": "Dynamo's RouterEvent JSON (also the dump format); unknown keys are ignored.",
    "type": "object",
    "required": ["worker_id", "event"],
    "properties": {
        "worker_id": _U64,
        "storage_tier": {"enum": [t.value for t in Tier]},
        "event": {"type": "object", "required": ["event_id", "data"], "properties": {
            "event_id": _U64,
            "dp_rank": _U32,
            "data": {"anyOf": [
                {"const": "cleared"},
                {"type": "object", "required": ["stored"], "properties": {"stored": {
                    "type": "object", "required": ["blocks"], "properties": {
                        "parent_hash": {"anyOf": [_U64, {"type": "null"}]},
                        "blocks": {"type": "array", "items": {
                            "type": "object", "required": ["block_hash", "tokens_hash"],
                            "properties": {"block_hash": _U64, "tokens_hash": _U64}}}}}}},
                {"type": "object", "required": ["removed"], "properties": {"removed": {
                    "type": "object", "required": ["block_hashes"],
                    "properties": {"block_hashes": {"type": "array", "items": _U64}}}}},
            ]},
        }},
    },
}
_SEQUENCE_EVENT: dict[str, Any] = {
    "title": "ActiveSequenceEvent",
    "description": "A router's decision as Dynamo 1.6.1's replica sync publishes it (`active_sequences_events`), "
                   "as JSON: an AddRequest for a request routed, then MarkPrefillCompleted and Free.",
    "type": "object",
    "required": ["request_id", "worker", "data", "router_id"],
    "properties": {
        "request_id": {"type": "string"},
        "worker": {"type": "object", "required": ["worker_id"], "properties": {"worker_id": _U64, "dp_rank": _U32}},
        "data": {"anyOf": [
            {"enum": ["Free", "MarkPrefillCompleted"]},
            {"type": "object", "required": ["AddRequest"], "properties": {"AddRequest": {
                "type": "object", "properties": {
                    "token_sequence": {"anyOf": [{"type": "array", "items": _U64}, {"type": "null"}],
                                       "description": "the prompt's blocks, as sequence hashes"},
                    "track_prefill_tokens": {"type": "boolean", "default": True},
                    "expected_output_tokens": {"anyOf": [_U32, {"type": "null"}]},
                    "prefill_load_hint": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
                        "initial_effective_prefill_tokens": {"anyOf": [_U64, {"type": "null"}]}}}]}}}}},
        ]},
        "router_id": _U64,
        "lora_name": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
}
_PROBLEM: dict[str, Any] = {
    "title": "Problem",
    "description": "What is wrong: an `Error`, or, for a body or query that does not fit its schema, an `Invalid`.",
    "anyOf": [ref("Error"), ref("Invalid")],
}
_LINES = {"type": "string", "description": "one RouterEvent per line"}
_EVENT_LIST = {"type": "array", "items": ref("RouterEvent")}
_EVENTS = {"application/json": {"schema": {"anyOf": [ref("RouterEvent"), _EVENT_LIST]}},
           "application/x-ndjson": {"schema": _LINES}}
_DECISIONS = {"application/json": {"schema": {"anyOf": [ref("ActiveSequenceEvent"), {
    "type": "array", "maxItems": 10_000, "items": ref("ActiveSequenceEvent")}]}},
    "application/x-ndjson": {"schema": {"type": "string", "description": "one ActiveSequenceEvent per line"}}}
_TREE = {"application/json": {"schema": _EVENT_LIST}, "application/x-ndjson": {"schema": _LINES}}
_METRICS = {"text/plain": {"schema": {"type": "string"}}}


@dataclass(frozen=True)
class Param:
    name: str
    schema: dict[str, Any]
    where: str = "query"
    required: bool = False
    description: str | None = None


_MODEL = Param("model", {"type": "string", "default": DEFAULT_MODEL}, description="the model")


@dataclass(frozen=True)
class Operation:
    """One route: `ok` the answer's Struct (or its `content` by media type), `errors` the statuses it answers
    itself, `body` the request body's Struct (or its content by media type)."""

    method: str
    path: str
    summary: str
    ok: type[msgspec.Struct] | dict[str, Any]
    errors: tuple[int, ...] = ()
    params: tuple[Param, ...] = ()
    body: type[msgspec.Struct] | dict[str, Any] | None = None
    body_required: bool = True
    status: int = 200


OPERATIONS = (
    Operation("GET", "/metrics", "Prometheus metrics", _METRICS),
    Operation("GET", "/v1/status", "The router's status", api.Status),
    Operation("GET", "/healthz", "Liveness", api.Health),
    Operation("GET", "/readyz", "Readiness: 200 once the index is whole, 503 (the same body) while restoring",
              api.Readiness),
    Operation("GET", "/v1/workers", "List workers", api.Workers),
    Operation("POST", "/v1/workers", "Register a worker", api.Worker, (400, 409, 422), body=api.WorkerBody,
              status=201),
    Operation("DELETE", "/v1/workers/{worker_id}", "Remove a worker", api.Removed, (404, 422),
              (Param("worker_id", {"type": "integer"}, "path", True),
               Param("dp_rank", {"type": "integer"}, description="one rank (all when left out)"))),
    Operation("POST", "/v1/events", "Apply RouterEvents", api.EventsApplied, (400, 404, 409, 422), (_MODEL,),
              body=_EVENTS),
    Operation("POST", "/v1/requests/{request_id}/prefill_complete", "Mark a request's prefill done",
              api.PrefillCompleted, (400, 404, 422), (Param("request_id", {"type": "string"}, "path", True), _MODEL),
              body=api.PrefillBody, body_required=False),
    Operation("DELETE", "/v1/requests/{request_id}", "Free a request", api.Freed, (404, 422),
              (Param("request_id", {"type": "string"}, "path", True), _MODEL)),
    Operation("GET", "/v1/tree", "The index as RouterEvents", _TREE, (400, 404, 422),
              (_MODEL, Param("worker", {"type": "string"}, description="ID or ID:DP"),
               Param("format", {"enum": ["json", "jsonl"], "default": "json"}))),
    Operation("GET", "/v1/tree/stats", "The index's size, and with shape=true its shape", api.TreeStats, (404, 422),
              (Param("model", {"type": "string"}, description="the model (every model when left out)"),
               Param("shape", {"enum": ["true", "false"], "default": "false"},
                     description="also paths, depths and shared_prefixes, walked in slices of the loop"),
               Param("top", {"type": "integer", "minimum": 0, "default": 10},
                     description="shared prefixes listed (with shape=true)"))),
    Operation("POST", "/v1/reset", "Clear the index", api.Cleared, (400, 404, 422), body=api.ResetBody),
    Operation("GET", "/v1/audit", "The decisions heard in a window, judged against the index", api.Audit,
              (404, 422), (Param("model", {"type": "string"}, description="the model (every model when left out)"),
                           Param("window", {"type": "number", "minimum": 0, "maximum": 86400, "default": 300},
                                 description="seconds back from now"),
                           Param("recent", {"type": "integer", "minimum": 0, "maximum": 1000, "default": 0},
                                 description="also the last N decisions of the window, explained"),
                           Param("what_if", {"type": "array", "items": {"type": "string"}},
                                 description="KNOB=VALUE (repeatable): the window's decisions priced again under "
                                             "these knobs"))),
    Operation("GET", "/v1/audit/{request_id}", "One recent decision, explained", api.AuditedDecision, (404, 422),
              (Param("request_id", {"type": "string", "minLength": 1, "maxLength": MAX_REQUEST_ID_CHARS}, "path",
                     True),)),
    Operation("POST", "/v1/decisions", "Hear other routers' decisions: each routed request audited, then booked",
              api.DecisionsHeard, (400, 404, 422), (_MODEL,), body=_DECISIONS),
    Operation("GET", "/busy_threshold", "Every model's busy thresholds", api.ThresholdsList),
    Operation("POST", "/busy_threshold", "Set a model's busy thresholds", api.Thresholds, (400, 404, 415, 422),
              body=api.BusyBody),
    Operation("DELETE", "/busy_threshold", "Turn a model's busy thresholds off", api.Thresholds, (400, 422),
              (Param("model", {"type": "string"}, required=True),
               Param("field", {"type": "array", "items": {"type": "string"}},
                     description="a threshold to turn off (all three when left out)"))),
    Operation("POST", "/v1/route", "Route a request", api.Decision, (400, 404, 422, 429, 503), body=api.RouteBody),
)


def _structs() -> list[type[msgspec.Struct]]:
    kinds: list[type[msgspec.Struct]] = [api.Error, api.Invalid]
    for op in OPERATIONS:
        kinds += [kind for kind in (op.ok, op.body) if isinstance(kind, type)]
    return list(dict.fromkeys(kinds))


def _content(kind: type[msgspec.Struct] | dict[str, Any]) -> dict[str, Any]:
    return kind if isinstance(kind, dict) else {"application/json": {"schema": ref(kind.__name__)}}


def _replies(*codes: int) -> dict[str, Any]:
    return {str(code): {"description": HTTPStatus(code).phrase, "content": {"application/json": {
        "schema": ref("Problem")}}} for code in codes}


def _operation(op: Operation, needs_admin: Callable[[str, str], bool]) -> dict[str, Any]:
    name = re.sub(r"\W+", "_", f"{op.method} {op.path}").strip("_").lower()
    out: dict[str, Any] = {"summary": op.summary, "operationId": name}
    if op.params:
        out["parameters"] = [{"name": p.name, "in": p.where, "required": p.required, "schema": p.schema,
                              **({"description": p.description} if p.description else {})} for p in op.params]
    if op.body is not None:
        out["requestBody"] = {"required": op.body_required, "content": _content(op.body)}
    extra = ([401] if needs_admin(op.method, op.path) else []) + ([413] if op.body is not None else [])
    out["responses"] = {str(op.status): {"description": HTTPStatus(op.status).phrase, "content": _content(op.ok)},
                        **_replies(*sorted({*op.errors, *extra}))}
    return out


def document(needs_admin: Callable[[str, str], bool]) -> dict[str, Any]:
    """The OpenAPI document of every route; `needs_admin(method, path)`: whether it needs the admin token."""
    _, schemas = msgspec.json.schema_components(_structs(), ref_template=_REF)
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method.lower()] = _operation(op, needs_admin)
    return {"openapi": "3.1.0", "info": {"title": "kvctl router", "version": __version__}, "paths": paths,
            "components": {"schemas": {**schemas, "RouterEvent": _ROUTER_EVENT,
                                                "ActiveSequenceEvent": _SEQUENCE_EVENT, "Problem": _PROBLEM}}}


_OFFLINE = """<p id="offline" hidden>This page loads its viewer's scripts from cdn.jsdelivr.net, which this browser
could not reach. The API's description needs no network: <a href="/openapi.json">/openapi.json</a>, or
docs/http-api.md in kvctl's source.</p>
<script>function offline() { document.getElementById("offline").hidden = false; }</script>
"""
"""Said on the page when the CDN cannot be reached (an offline or air-gapped machine), instead of a blank page."""
_SWAGGER_UI = f"""<!doctype html>
<html><head><title>kvctl router: API</title>
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css"></head>
<body>{_OFFLINE}<div id="swagger-ui"></div>
<script src="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js" onerror="offline()"></script>
<script>if (window.SwaggerUIBundle) SwaggerUIBundle({{url: "/openapi.json", dom_id: "#swagger-ui"}})</script>
</body></html>
"""
_REDOC = f"""<!doctype html>
<html><head><title>kvctl router: API</title></head>
<body>{_OFFLINE}<redoc spec-url="/openapi.json"></redoc>
<script src="https://cdn.jsdelivr.net/npm/redoc@2/bundles/redoc.standalone.js" onerror="offline()"></script>
</body></html>
"""


def pages(openapi: Callable[[], dict[str, Any]]) -> list[Route]:
    """The documentation routes: the document itself, and Swagger UI and ReDoc over it (for people exploring the
    API; their scripts come from a CDN, as the browser that shows them can reach one). The document is built when
    first asked for, not at start: its schema pass over every Struct would hold back the port's opening."""
    body = functools.cache(lambda: msgspec.json.encode(openapi()))

    def page(content: Callable[[], bytes | str], media_type: str) -> Callable[[Request], Awaitable[Response]]:
        async def serve(_: Request) -> Response:
            return Response(content(), media_type=media_type)

        return serve

    return [Route("/openapi.json", page(body, "application/json"), methods=["GET"]),
            Route("/docs", page(lambda: _SWAGGER_UI, "text/html"), methods=["GET"]),
            Route("/redoc", page(lambda: _REDOC, "text/html"), methods=["GET"])]
