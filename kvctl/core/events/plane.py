"""Dynamo's event plane besides RouterEvent: subject and JetStream names, load reports, replica sync.

Names follow Dynamo 1.6.1 (DESIGN §3.2): the event-plane subjects are raw
(`namespace.{ns}.component.{comp}.kv-events`), the JetStream stream and object-store bucket are
slugs of them. Payloads are rmp-serde named-field msgpack: `ActiveLoad` on `namespace.{ns}.kv_metrics`
and `ActiveSequenceEvent` (externally tagged `data`, PascalCase variants) on
`…active_sequences_events`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from kvctl.core.events.errors import DecodeError, ErrorKind, describe, parse_msgpack, require

_U32_MAX = (1 << 32) - 1
_U64_MAX = (1 << 64) - 1

RADIX_STATE_OBJECT = "radix-state"


def slugify(name: str) -> str:
    """Dynamo's `Slug::slugify(...).replace('_', '-')`: lowercase, `[a-z0-9_-]` kept, the rest `_`, then
    leading `_` trimmed and every `_` made `-`."""
    return re.sub(r"[^a-z0-9_-]", "_", name.lower()).lstrip("_").replace("_", "-")


@dataclass(frozen=True, slots=True)
class PlaneNames:
    """Every subject, stream and bucket name of one (namespace, worker component)."""

    namespace: str
    component: str

    @property
    def kv_events(self) -> str:
        return f"namespace.{self.namespace}.component.{self.component}.kv-events"

    @property
    def kv_metrics(self) -> str:
        return f"namespace.{self.namespace}.kv_metrics"

    @property
    def active_sequences(self) -> str:
        return f"namespace.{self.namespace}.component.{self.component}.active_sequences_events"

    @property
    def stream(self) -> str:
        return slugify(self.kv_events)

    @property
    def stream_subject(self) -> str:
        """Where workers publish RouterEvent JSON in JetStream mode (the stream is bound to `{stream}.*`)."""
        return f"{self.stream}.kv-events"

    @property
    def bucket(self) -> str:
        return slugify(f"namespace.{self.namespace}.component.{self.component}-radix-bucket")


@dataclass(frozen=True, slots=True)
class ActiveLoad:
    """A load report: workers send their KV occupancy (`kv_used_blocks`), routers their in-flight view."""

    worker_id: int
    dp_rank: int
    active_decode_blocks: int | None
    active_prefill_tokens: int | None
    kv_used_blocks: int | None


def decode_active_load(data: bytes) -> ActiveLoad:
    obj = _map(parse_msgpack(data), "ActiveLoad")
    return ActiveLoad(
        worker_id=_uint(require(obj, "worker_id"), "worker_id"),
        dp_rank=_uint(obj.get("dp_rank", 0), "dp_rank", _U32_MAX),
        active_decode_blocks=_optional_uint(obj.get("active_decode_blocks"), "active_decode_blocks"),
        active_prefill_tokens=_optional_uint(obj.get("active_prefill_tokens"), "active_prefill_tokens"),
        kv_used_blocks=_optional_uint(obj.get("kv_used_blocks"), "kv_used_blocks"),
    )


def encode_active_load(load: ActiveLoad) -> bytes:
    return msgspec.msgpack.encode({
        "worker_id": load.worker_id, "dp_rank": load.dp_rank, "active_decode_blocks": load.active_decode_blocks,
        "active_prefill_tokens": load.active_prefill_tokens, "kv_used_blocks": load.kv_used_blocks,
    })


@dataclass(frozen=True, slots=True)
class AddRequest:
    token_sequence: list[int] | None  # the prompt's block (sequence) hashes
    track_prefill_tokens: bool = True
    expected_output_tokens: int | None = None
    prefill_tokens_hint: int | None = None  # prefill_load_hint.initial_effective_prefill_tokens


SequenceAction = AddRequest | str  # "Free" | "MarkPrefillCompleted"
FREE = "Free"
PREFILL_COMPLETED = "MarkPrefillCompleted"


@dataclass(frozen=True, slots=True)
class ActiveSequenceEvent:
    request_id: str
    worker_id: int
    dp_rank: int
    action: SequenceAction
    router_id: int
    lora_name: str | None = None


def decode_sequence_event(data: bytes) -> ActiveSequenceEvent:
    obj = _map(parse_msgpack(data), "ActiveSequenceEvent")
    request_id = require(obj, "request_id")
    if not isinstance(request_id, str):
        raise DecodeError(ErrorKind.bad_type, "request_id", f"expected a string, got {describe(request_id)}")
    worker = _map(require(obj, "worker"), "worker")
    lora_name = obj.get("lora_name")
    if lora_name is not None and not isinstance(lora_name, str):
        raise DecodeError(ErrorKind.bad_type, "lora_name", f"expected a string, got {describe(lora_name)}")
    return ActiveSequenceEvent(
        request_id=request_id,
        worker_id=_uint(require(worker, "worker_id", "worker.worker_id"), "worker.worker_id"),
        dp_rank=_uint(worker.get("dp_rank", 0), "worker.dp_rank", _U32_MAX),
        action=_action(require(obj, "data")),
        router_id=_uint(require(obj, "router_id"), "router_id"),
        lora_name=lora_name,
    )


def encode_sequence_event(ev: ActiveSequenceEvent) -> bytes:
    if isinstance(ev.action, AddRequest):
        add = ev.action
        hint = None if add.prefill_tokens_hint is None else {
            "initial_effective_prefill_tokens": add.prefill_tokens_hint, "expected_prefill_duration": None}
        data: Any = {"AddRequest": {
            "token_sequence": add.token_sequence, "track_prefill_tokens": add.track_prefill_tokens,
            "expected_output_tokens": add.expected_output_tokens, "prefill_load_hint": hint}}
    else:
        data = ev.action
    return msgspec.msgpack.encode({
        "request_id": ev.request_id, "worker": {"worker_id": ev.worker_id, "dp_rank": ev.dp_rank},
        "data": data, "router_id": ev.router_id, "lora_name": ev.lora_name,
    })


def _action(data: Any) -> SequenceAction:
    if data in (FREE, PREFILL_COMPLETED):
        return data
    if not (isinstance(data, dict) and len(data) == 1 and "AddRequest" in data):
        raise DecodeError(ErrorKind.unknown_type, "data",
                          f"expected AddRequest, Free or MarkPrefillCompleted, got {describe(data)}")
    add = _map(data["AddRequest"], "data.AddRequest")
    tokens = add.get("token_sequence")
    if tokens is not None and not (isinstance(tokens, list) and all(type(t) is int and 0 <= t <= _U64_MAX
                                                                    for t in tokens)):
        raise DecodeError(ErrorKind.bad_hash, "token_sequence", f"expected u64 hashes, got {describe(tokens)}")
    track = add.get("track_prefill_tokens", True)
    if not isinstance(track, bool):
        raise DecodeError(ErrorKind.bad_type, "track_prefill_tokens", f"expected a bool, got {describe(track)}")
    hint = add.get("prefill_load_hint")
    hint_tokens = None
    if hint is not None:
        hint_tokens = _optional_uint(_map(hint, "prefill_load_hint").get("initial_effective_prefill_tokens"),
                                     "prefill_load_hint.initial_effective_prefill_tokens")
    return AddRequest(tokens, track, _optional_uint(add.get("expected_output_tokens"), "expected_output_tokens",
                                                    _U32_MAX), hint_tokens)


def _map(value: Any, field: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise DecodeError(ErrorKind.bad_type, field, f"expected a map, got {describe(value)}")
    return value


def _uint(value: Any, field: str, maximum: int = _U64_MAX) -> int:
    if type(value) is not int or not 0 <= value <= maximum:
        raise DecodeError(ErrorKind.bad_type, field, f"expected an unsigned int, got {describe(value)}")
    return value


def _optional_uint(value: Any, field: str, maximum: int = _U64_MAX) -> int | None:
    return None if value is None else _uint(value, field, maximum)
