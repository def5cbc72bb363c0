"""What /openapi.json says the router answers, beyond what FastAPI infers from the handlers' signatures.

Most handlers write their own JSON (`Response`), so FastAPI knows neither their bodies nor their error statuses,
and `POST /v1/route` is answered before FastAPI sees it. Here: the schemas of the answers, the statuses each
operation can give (`replies()`, used in the route decorators), and `complete()`, which adds what the outer layer
(`_Front`) answers for every operation (401 without the admin token, 413 over the body cap) and the route
operation. A client generated from the document, or schemathesis, then meets no status and no body it was not
told about.
"""

from __future__ import annotations

from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import msgspec

from kvctl.core.events import Tier

_REF = "#/components/schemas/{name}"
U64 = {"type": "integer", "minimum": 0, "maximum": 2**64 - 1}
U32 = {"type": "integer", "minimum": 0, "maximum": 2**32 - 1}
_COUNT = {"type": "integer", "minimum": 0}
_NULLABLE_NUMBER = {"anyOf": [{"type": "number"}, {"type": "null"}]}


def ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(name=name)}


SCHEMAS: dict[str, dict[str, Any]] = {
    "Problem": {
        "title": "Problem",
        # `error` is kvctl's own message; `detail` is FastAPI's (request validation).
        "description": "What is wrong: `error`, a message (with fields beside it that give the context), or "
                       "`detail`, a message or one item per invalid field.",
        "type": "object",
        "anyOf": [{"required": ["error"]}, {"required": ["detail"]}],
        "properties": {
            "error": {"type": "string", "minLength": 1},
            "detail": {"anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["loc", "msg", "type"],
                    "properties": {"loc": {"type": "array"}, "msg": {"type": "string"}, "type": {"type": "string"}}}},
            ]},
        },
    },
    "RouterEvent": {
        "title": "RouterEvent",
        "description": "Dynamo's RouterEvent JSON (also the dump format); unknown keys are ignored.",
        "type": "object",
        "required": ["worker_id", "event"],
        "properties": {
            "worker_id": U64,
            "storage_tier": {"enum": [t.value for t in Tier]},
            "event": {"type": "object", "required": ["event_id", "data"], "properties": {
                "event_id": U64,
                "dp_rank": U32,
                "data": {"anyOf": [
                    {"const": "cleared"},
                    {"type": "object", "required": ["stored"], "properties": {"stored": {
                        "type": "object", "required": ["blocks"], "properties": {
                            "parent_hash": {"anyOf": [U64, {"type": "null"}]},
                            "blocks": {"type": "array", "items": {
                                "type": "object", "required": ["block_hash", "tokens_hash"],
                                "properties": {"block_hash": U64, "tokens_hash": U64}}}}}}},
                    {"type": "object", "required": ["removed"], "properties": {"removed": {
                        "type": "object", "required": ["block_hashes"],
                        "properties": {"block_hashes": {"type": "array", "items": U64}}}}},
                ]},
            }},
        },
    },
    "Worker": {
        "title": "Worker",
        "type": "object",
        "required": ["worker_id", "dp_rank", "model", "blocks", "busy"],
        "properties": {"worker_id": U64, "dp_rank": U32, "model": {"type": "string"}, "blocks": _COUNT,
                       "busy": {"type": "boolean"}},
    },
    "Thresholds": {
        "title": "Thresholds",
        "type": "object",
        "required": ["model", "active_decode_blocks_threshold", "active_prefill_tokens_threshold",
                     "active_prefill_tokens_threshold_frac"],
        "properties": {"model": {"type": "string"}, "active_decode_blocks_threshold": _NULLABLE_NUMBER,
                       "active_prefill_tokens_threshold": {"anyOf": [U64, {"type": "null"}]},
                       "active_prefill_tokens_threshold_frac": _NULLABLE_NUMBER},
    },
    "Decision": {
        "title": "Decision",
        "type": "object",
        "required": ["worker_id", "dp_rank", "overlap_blocks", "required_blocks", "request_id", "reason"],
        "properties": {"worker_id": U64, "dp_rank": U32, "overlap_blocks": _COUNT, "required_blocks": _COUNT,
                       "request_id": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                       "reason": {"type": "string"}, "candidates": {"type": "array", "items": {"type": "object"}}},
    },
}

OBJECT = {"type": "object"}
EVENTS_APPLIED = {"type": "object", "required": ["applied", "rejected"],
                  "properties": {"applied": _COUNT, "rejected": {"type": "object", "additionalProperties": _COUNT}}}
EVENTS_BODY = {"required": True, "content": {
    "application/json": {"schema": {"anyOf": [ref("RouterEvent"), {"type": "array", "items": ref("RouterEvent")}]}},
    "application/x-ndjson": {"schema": {"type": "string", "description": "one RouterEvent per line"}},
}}
TREE = {"application/json": {"schema": {"type": "array", "items": ref("RouterEvent")}},
        "application/x-ndjson": {"schema": {"type": "string", "description": "one RouterEvent per line"}}}


def body_of(kind: type, *, required: bool = True) -> dict[str, Any]:
    """The `requestBody` of an operation whose body is `kind` (a Struct of `kvctl.http_api`)."""
    _, components = msgspec.json.schema_components([kind], ref_template=_REF)
    schema = components[kind.__name__]
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": schema}}}}


def replies(*errors: int, ok: dict[str, Any] | None = None, status: int = 200,
            content: dict[str, Any] | None = None) -> dict[int | str, dict[str, Any]]:
    """The `responses` of a route: its success body (`ok`, a JSON schema, or `content` by media type) and the
    error statuses it answers itself, each with a Problem body."""
    out: dict[int | str, dict[str, Any]] = {
        code: {"description": HTTPStatus(code).phrase, "content": {"application/json": {"schema": ref("Problem")}}}
        for code in errors}
    if ok is not None or content is not None:
        out[status] = {"content": content if content is not None else {"application/json": {"schema": ok}}}
    return out


def complete(document: dict[str, Any], route: type, needs_admin: Callable[[str, str], bool]) -> dict[str, Any]:
    """Add the components, the route operation (`route`: its msgspec body type), and what the outer layer answers:
    401 where the admin token is needed, 413 where a body can be sent."""
    body_schema, components = msgspec.json.schema_components([route], ref_template=_REF)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(components)
    schemas.update(SCHEMAS)
    document["paths"]["/v1/route"] = {"post": {
        "summary": "Route", "operationId": "route",
        "requestBody": {"required": True, "content": {"application/json": {"schema": body_schema[0]}}},
        "responses": {str(k): v for k, v in replies(400, 404, 422, 429, 503, ok=ref("Decision")).items()},
    }}
    for path, item in document["paths"].items():
        for method, operation in item.items():
            responses = operation.setdefault("responses", {})
            extra = ([401] if needs_admin(method.upper(), path) else []) + ([413] if "requestBody" in operation else [])
            for code, reply in replies(*extra).items():
                responses.setdefault(str(code), reply)
    return document
