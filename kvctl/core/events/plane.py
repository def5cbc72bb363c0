"""Dynamo's event plane besides RouterEvent: subjects, topics, load reports, forward passes, replica sync.

Checked against a running Dynamo 1.6.1 fleet (docs/contract.md): every message is published on
`namespace.{ns}.component.{comp}.endpoint.{ep}.{topic}` inside the same msgpack envelope, whatever the
topic. Payloads are rmp-serde named-field msgpack: an array of RouterEvents on `kv-events`, `ActiveLoad`
on `kv_metrics`, `ActiveSequenceEvent` (externally tagged `data`, PascalCase variants) on
`active_sequences_events` and `ForwardPassMetrics` on `forward-pass-metrics`. The JetStream names are
kvctl's own durable plane, laid out as Dynamo's earlier durable mode was (Dynamo 1.6.1 creates none).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from kvctl.core.events.errors import (
    DecodeError,
    ErrorKind,
    as_map,
    as_uint,
    decode_each,
    describe,
    parse_msgpack,
    require,
)

_U32_MAX = (1 << 32) - 1
_U64_MAX = (1 << 64) - 1

RADIX_STATE_OBJECT = "radix-state"

KV_EVENTS = "kv-events"
KV_METRICS = "kv_metrics"
ACTIVE_SEQUENCES = "active_sequences_events"
FORWARD_PASS = "forward-pass-metrics"
TOPICS = (KV_EVENTS, KV_METRICS, ACTIVE_SEQUENCES, FORWARD_PASS)

DEFAULT_COMPONENT = "backend"
DEFAULT_ENDPOINT = "generate"
"""What `dynamo.mocker`, `dynamo.vllm` and `dynamo.sglang` register unless told otherwise."""


def slugify(name: str) -> str:
    """Dynamo's `Slug::slugify(...).replace('_', '-')`: lowercase, `[a-z0-9_-]` kept, the rest `_`, then
    leading `_` trimmed and every `_` made `-`."""
    return re.sub(r"[^a-z0-9_-]", "_", name.lower()).lstrip("_").replace("_", "-")


@dataclass(frozen=True, slots=True)
class PlaneNames:
    """Every subject, stream and bucket name of one (namespace, component, endpoint): where to publish."""

    namespace: str
    component: str = DEFAULT_COMPONENT
    endpoint: str = DEFAULT_ENDPOINT

    def subject(self, topic: str) -> str:
        return f"namespace.{self.namespace}.component.{self.component}.endpoint.{self.endpoint}.{topic}"

    @property
    def kv_events(self) -> str:
        return self.subject(KV_EVENTS)

    @property
    def kv_metrics(self) -> str:
        return self.subject(KV_METRICS)

    @property
    def active_sequences(self) -> str:
        return self.subject(ACTIVE_SEQUENCES)

    @property
    def forward_pass(self) -> str:
        return self.subject(FORWARD_PASS)

    @property
    def stream(self) -> str:
        """kvctl's JetStream stream: one per component, named as Dynamo's earlier durable mode named it."""
        return slugify(f"namespace.{self.namespace}.component.{self.component}.kv-events")

    @property
    def stream_subject(self) -> str:
        """Where workers publish RouterEvent JSON in JetStream mode (the stream is bound to `{stream}.*`)."""
        return f"{self.stream}.kv-events"

    @property
    def bucket(self) -> str:
        return slugify(f"namespace.{self.namespace}.component.{self.component}-radix-bucket")


@dataclass(frozen=True, slots=True)
class PlaneScope:
    """What a subscriber follows: a namespace, narrowed to one component and/or endpoint (None: every one)."""

    namespace: str
    component: str | None = None
    endpoint: str | None = None

    @property
    def subscription(self) -> str:
        """The one NATS subscription: the whole namespace, so that what it carries besides our topics (a
        typo'd component, an unknown topic) is seen and can be named, not silently missed."""
        return f"namespace.{self.namespace}.>"

    def pattern(self, topic: str) -> str:
        """The subject of a topic in this scope, `*` where every component or endpoint is followed."""
        return (f"namespace.{self.namespace}.component.{self.component or '*'}"
                f".endpoint.{self.endpoint or '*'}.{topic}")

    def match(self, subject: str) -> tuple[str, str, str] | None:
        """(component, endpoint, topic) of a subject this scope follows; None for any other subject."""
        parts = subject.split(".")
        if (len(parts) != 7 or parts[0] != "namespace" or parts[1] != self.namespace or parts[2] != "component"
                or parts[4] != "endpoint"):
            return None
        component, endpoint, topic = parts[3], parts[5], parts[6]
        if self.component not in (None, component) or self.endpoint not in (None, endpoint):
            return None
        return component, endpoint, topic

    def names(self, component: str | None = None, endpoint: str | None = None) -> PlaneNames:
        """Concrete names to publish under: the given ones, else this scope's, else Dynamo's defaults."""
        return PlaneNames(self.namespace, component or self.component or DEFAULT_COMPONENT,
                          endpoint or self.endpoint or DEFAULT_ENDPOINT)


@dataclass(frozen=True, slots=True)
class ActiveLoad:
    """A load report: workers send their KV occupancy (`kv_used_blocks`), routers their in-flight view."""

    worker_id: int
    dp_rank: int
    active_decode_blocks: int | None
    active_prefill_tokens: int | None
    kv_used_blocks: int | None


def decode_active_load(data: bytes) -> ActiveLoad:
    obj = as_map(parse_msgpack(data), "ActiveLoad")
    return ActiveLoad(
        worker_id=as_uint(require(obj, "worker_id"), "worker_id"),
        dp_rank=as_uint(obj.get("dp_rank", 0), "dp_rank", _U32_MAX),
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
    """One bare event: what Dynamo 1.6.1 publishes on its NATS plane."""
    return sequence_event_of(parse_msgpack(data))


def decode_sequence_events(data: bytes) -> tuple[list[ActiveSequenceEvent], list[DecodeError]]:
    """An `active_sequences_events` payload of either plane: a batch `{"events": [...]}` (Dynamo 1.6.1's ZMQ
    plane) or one bare event (its NATS plane). A bad event costs itself, not its batch: it comes back as a
    DecodeError with its index; a batch that is not an array is bad_batch."""
    obj = parse_msgpack(data)
    if not (isinstance(obj, dict) and "events" in obj and "request_id" not in obj):
        return [sequence_event_of(obj)], []
    items = obj["events"]
    if not isinstance(items, list):
        raise DecodeError(ErrorKind.bad_batch, "events", f"expected an array of events, got {describe(items)}")
    return decode_each(items, sequence_event_of)


def encode_sequence_events(events: list[ActiveSequenceEvent]) -> bytes:
    """The ZMQ plane's batch `{"events": [...]}`, each event as `encode_sequence_event` writes it."""
    return msgspec.msgpack.encode({"events": [msgspec.Raw(encode_sequence_event(e)) for e in events]})


def sequence_event_of(value: Any) -> ActiveSequenceEvent:
    """One event from its decoded object, msgpack's or serde JSON's (a recording's): the same shape. DecodeError
    naming the field that does not fit."""
    obj = as_map(value, "ActiveSequenceEvent")
    request_id = require(obj, "request_id")
    if not isinstance(request_id, str):
        raise DecodeError(ErrorKind.bad_type, "request_id", f"expected a string, got {describe(request_id)}")
    worker = as_map(require(obj, "worker"), "worker")
    lora_name = obj.get("lora_name")
    if lora_name is not None and not isinstance(lora_name, str):
        raise DecodeError(ErrorKind.bad_type, "lora_name", f"expected a string, got {describe(lora_name)}")
    return ActiveSequenceEvent(
        request_id=request_id,
        worker_id=as_uint(require(worker, "worker_id", "worker.worker_id"), "worker.worker_id"),
        dp_rank=as_uint(worker.get("dp_rank", 0), "worker.dp_rank", _U32_MAX),
        action=_action(require(obj, "data")),
        router_id=as_uint(require(obj, "router_id"), "router_id"),
        lora_name=lora_name,
    )


def encode_sequence_event(ev: ActiveSequenceEvent) -> bytes:
    return msgspec.msgpack.encode(sequence_event_obj(ev))


def sequence_event_obj(ev: ActiveSequenceEvent) -> dict[str, Any]:
    """The event as Dynamo 1.6.1's serde writes it, field order included: msgpack on the plane, JSON in a
    recording (`events record --decisions`)."""
    if isinstance(ev.action, AddRequest):
        add = ev.action
        hint = None if add.prefill_tokens_hint is None else {
            "initial_effective_prefill_tokens": add.prefill_tokens_hint, "expected_prefill_duration": None}
        data: Any = {"AddRequest": {
            "token_sequence": add.token_sequence, "track_prefill_tokens": add.track_prefill_tokens,
            "expected_output_tokens": add.expected_output_tokens, "prefill_load_hint": hint}}
    else:
        data = ev.action
    return {"request_id": ev.request_id, "worker": {"worker_id": ev.worker_id, "dp_rank": ev.dp_rank},
            "data": data, "router_id": ev.router_id, "lora_name": ev.lora_name}


def _action(data: Any) -> SequenceAction:
    if isinstance(data, str) and data in (FREE, PREFILL_COMPLETED):
        return data
    if not (isinstance(data, dict) and len(data) == 1 and "AddRequest" in data):
        raise DecodeError(ErrorKind.unknown_type, "data",
                          f"expected AddRequest, Free or MarkPrefillCompleted, got {describe(data)}")
    add = as_map(data["AddRequest"], "data.AddRequest")
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
        hint_tokens = _optional_uint(as_map(hint, "prefill_load_hint").get("initial_effective_prefill_tokens"),
                                     "prefill_load_hint.initial_effective_prefill_tokens")
    return AddRequest(tokens, track, _optional_uint(add.get("expected_output_tokens"), "expected_output_tokens",
                                                    _U32_MAX), hint_tokens)


@dataclass(frozen=True, slots=True)
class RequestCounts:
    """Requests and tokens of one kind in a forward pass: scheduled into it, or still queued.

    `prefill_kv_tokens` (prefix already cached) is only reported for scheduled requests."""

    prefill_requests: int = 0
    prefill_tokens: int = 0
    prefill_length_var: float = 0.0
    prefill_kv_tokens: int | None = None
    decode_requests: int = 0
    decode_kv_tokens: int = 0
    decode_kv_tokens_var: float = 0.0


_COUNT_KEYS = (  # (wire name, field name, is an int), in Dynamo 1.6.1's order
    ("num_prefill_requests", "prefill_requests", True), ("sum_prefill_tokens", "prefill_tokens", True),
    ("var_prefill_length", "prefill_length_var", False), ("sum_prefill_kv_tokens", "prefill_kv_tokens", True),
    ("num_decode_requests", "decode_requests", True), ("sum_decode_kv_tokens", "decode_kv_tokens", True),
    ("var_decode_kv_tokens", "decode_kv_tokens_var", False),
)


@dataclass(frozen=True, slots=True)
class ForwardPass:
    """A worker's `forward-pass-metrics` report, sent every forward pass: what it ran and what waits.

    Dynamo writes `worker_id` as a decimal string here (a u64 in every other payload)."""

    worker_id: int
    dp_rank: int
    counter_id: int
    wall_time: float
    scheduled: RequestCounts
    queued: RequestCounts
    version: int = 1


def decode_forward_pass(data: bytes) -> ForwardPass:
    obj = as_map(parse_msgpack(data), "ForwardPassMetrics")
    worker_id = require(obj, "worker_id")
    if isinstance(worker_id, str) and len(worker_id) <= 20 and worker_id.isascii() and worker_id.isdecimal():
        worker_id = int(worker_id)  # a u64 has at most 20 digits; int() of thousands would raise ValueError
    return ForwardPass(
        worker_id=as_uint(worker_id, "worker_id"),
        dp_rank=as_uint(obj.get("dp_rank", 0), "dp_rank", _U32_MAX),
        counter_id=as_uint(obj.get("counter_id", 0), "counter_id"),
        wall_time=_number(obj.get("wall_time", 0.0), "wall_time"),
        scheduled=_request_counts(require(obj, "scheduled_requests"), "scheduled_requests"),
        queued=_request_counts(require(obj, "queued_requests"), "queued_requests"),
        version=as_uint(obj.get("version", 1), "version", _U32_MAX),
    )


def encode_forward_pass(report: ForwardPass) -> bytes:
    """Dynamo 1.6.1's bytes for a report, key order included."""

    def counts(c: RequestCounts) -> dict[str, Any]:
        values = {wire: getattr(c, name) for wire, name, _ in _COUNT_KEYS}
        if c.prefill_kv_tokens is None:
            del values["sum_prefill_kv_tokens"]
        return values

    return msgspec.msgpack.encode({
        "version": report.version, "worker_id": str(report.worker_id), "dp_rank": report.dp_rank,
        "counter_id": report.counter_id, "wall_time": report.wall_time,
        "scheduled_requests": counts(report.scheduled), "queued_requests": counts(report.queued),
    })


def _request_counts(value: Any, field: str) -> RequestCounts:
    obj = as_map(value, field)
    values: dict[str, Any] = {}
    for wire, name, is_int in _COUNT_KEYS:
        if wire in obj:
            values[name] = as_uint(obj[wire], f"{field}.{wire}") if is_int else _number(obj[wire], f"{field}.{wire}")
    return RequestCounts(**values)


def _number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, float | int) or not math.isfinite(value):
        raise DecodeError(ErrorKind.bad_type, field, f"expected a finite number, got {describe(value)}")
    return float(value)


def _optional_uint(value: Any, field: str, maximum: int = _U64_MAX) -> int | None:
    return None if value is None else as_uint(value, field, maximum)
