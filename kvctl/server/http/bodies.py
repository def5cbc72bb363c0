"""The bodies `kvctl serve`'s API reads (docs/http-api.md), and the readers of the ones parsed by hand.

Apart from the handlers so that what a request may hold is read in one place, and the route's body,
read on every routing decision, can be timed and tested alone (benchmarks/native_bench.py).
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterator
from typing import Annotated, Any

import msgspec
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvctl.core.router.scoring import KNOBS
from kvctl.core.token_json import token_ids_at_head, token_ids_from_json
from kvctl.server.ingest.endpoint import check_endpoint
from kvctl.server.state import DEFAULT_MODEL

U64 = Annotated[int, Field(ge=0, le=2**64 - 1)]
U32 = Annotated[int, Field(ge=0, le=2**32 - 1)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WorkerBody(_Body):
    worker_id: U64
    dp_rank: U32 = 0
    endpoint: str | None = Field(None, description="The engine's PUB socket: tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    replay_endpoint: str | None = Field(None, description="Its replay ROUTER socket, in the same forms")
    model: str = DEFAULT_MODEL
    topic: str = ""
    total_blocks: Annotated[int, Field(gt=0)] | None = None

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _connectable(cls, value: str | None) -> str | None:
        return None if value is None else check_endpoint(value)


# Kept raw by msgspec and read by `token_ids_from_json`; the schema says what it must hold.
_TOKEN_IDS = Annotated[msgspec.Raw, msgspec.Meta(extra_json_schema={
    "anyOf": [{"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2**32 - 1}}, {"type": "null"}]})]
_JSON_NULL = msgspec.Raw(b"null")
_MU64 = Annotated[int, msgspec.Meta(ge=0)]  # msgspec bounds stop at int64: the upper bound is checked below
_WEIGHT = Annotated[float, msgspec.Meta(ge=0)]


# Decoded with msgspec, not pydantic, and the token ids by a C reader: a 2048-token prompt validates in ~25 µs
# instead of ~190 µs, on the hot path of every routing decision. The docstring is the API's description.
class RouteBody(msgspec.Struct, forbid_unknown_fields=True):
    """A request to route: the prompt's `token_ids` (or its blocks' `local_hashes`) for a `model`, and optionally
    this request's own router settings, by their Dynamo names. Unknown fields are refused (422)."""

    model: str = DEFAULT_MODEL
    token_ids: _TOKEN_IDS | msgspec.UnsetType = msgspec.UNSET
    local_hashes: list[_MU64] | None = None
    lora_name: str | None = None
    request_id: str | None = None
    reserve: bool = False
    explain: bool = False
    # This request's own router knobs (docs/contract.md), by their Dynamo names; the last two are legacy aliases.
    overlap_score_credit: _WEIGHT | None = None
    overlap_score_credit_decay: _WEIGHT | None = None
    prefill_load_scale: _WEIGHT | None = None
    decode_active_request_weight: _WEIGHT | None = None
    host_cache_hit_weight: _WEIGHT | None = None
    disk_cache_hit_weight: _WEIGHT | None = None
    router_temperature: _WEIGHT | None = None
    track_prefill_tokens: bool | None = None
    overlap_score_weight: _WEIGHT | None = None
    temperature: _WEIGHT | None = None


OVERRIDES = (*KNOBS, "overlap_score_weight", "temperature")
_ROUTE_BODY = msgspec.json.Decoder(RouteBody)


def read_route_body(raw: bytes) -> tuple[RouteBody, array | None]:
    """A route request and its token ids (None: not given); msgspec.DecodeError or ValueError when invalid.

    A body that opens with its token ids (as clients send them) has them read in one pass, and only its
    other members go through msgspec; any other body, or one where that reading has any doubt (an error,
    a second `token_ids`), is read whole, so both readings agree on every body."""
    head = token_ids_at_head(raw)
    if head is not None:
        token_ids, rest = head
        try:
            body = _ROUTE_BODY.decode(rest)
        except ValueError:  # msgspec.DecodeError included; read whole below, which words the error
            pass
        else:
            if body.token_ids is msgspec.UNSET:
                return body, token_ids
    return read_route_body_whole(raw)


def read_route_body_whole(raw: bytes) -> tuple[RouteBody, array | None]:
    """`read_route_body` for any body: msgspec keeps the token ids raw, the C reader reads them."""
    body = _ROUTE_BODY.decode(raw)
    raw_ids = body.token_ids
    return body, None if raw_ids is msgspec.UNSET or raw_ids == _JSON_NULL else token_ids_from_json(raw_ids)


class PrefillBody(_Body):
    cached_tokens: Annotated[int, Field(ge=0, description="Prompt tokens the engine found cached (its usage's "
                                        "prompt_tokens_details.cached_tokens)")] | None = None


class ResetBody(_Body):
    model: str | None = None
    worker_id: U64 | None = None
    dp_rank: U32 | None = None


# Read as Dynamo's frontend reads it (serde): unknown fields ignored, no string-to-number coercion.
class BusyBody(BaseModel):
    """A model and the thresholds to set (a threshold not named keeps its value). Unknown fields are ignored;
    numbers must be JSON numbers, not strings."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    active_decode_blocks_threshold: float | None = None
    active_prefill_tokens_threshold: Annotated[int, Field(ge=0)] | None = None
    active_prefill_tokens_threshold_frac: float | None = None


def json_content_type(value: str) -> bool:
    """application/json or application/*+json, parameters allowed: what axum's Json extractor takes."""
    mime = value.split(";", 1)[0].strip().lower()
    kind, _, subtype = mime.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def parse_events(raw: bytes, content_type: str) -> Iterator[Any]:
    """The items of a JSON object, a JSON list, or JSONL: raises ValueError when the body is none of them."""
    if "ndjson" in content_type or "jsonl" in content_type:
        for n, line in enumerate(raw.splitlines(), 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
                    raise ValueError(f"line {n} is not JSON: {exc}") from None
        return
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"body is not JSON ({exc}); send a RouterEvent, a list of them, or JSONL with "
                         "Content-Type: application/x-ndjson") from None
    yield from (body if isinstance(body, list) else [body])
