"""Dynamo's RouterEvent (JSON and rmp-serde msgpack) and its event-plane envelope (docs/contract.md).

This is the format of Dynamo's dumps, its JetStream stream and its NATS event plane, so kvctl
both reads it (to follow a Dynamo fleet, to load a dump) and writes it (its own dumps must load
into Dynamo). Decoding follows Dynamo 1.6.1's serde rules, checked against what its binary accepts
(fixtures/dynamo-1.6.1/errors.json): hashes and ids are strict u64 (no sign bit-cast here: that
is an engine quirk, not Dynamo's), unknown keys are ignored, `storage_tier` and `dp_rank` default.
Encoding reproduces Dynamo 1.6.1's own bytes, key order included.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from kvctl.core.events.errors import (
    DecodeError,
    ErrorKind,
    decode_each,
    describe,
    parse_json,
    parse_msgpack,
    require,
)
from kvctl.core.events.types import Cleared, EventData, Removed, RouterEvent, Stored, Tier

_U32_MAX = (1 << 32) - 1
_U64_MAX = (1 << 64) - 1

RESIDENCY_DOMAIN = "worker"
"""What Dynamo 1.6.1 writes as `residency_domain` for worker-held blocks; kvctl has no other domain."""


class EventEnvelope(msgspec.Struct, frozen=True):
    """The event plane's outer message, the same on every topic; `payload` is the topic's own msgpack
    (for `kv-events`, an array of RouterEvents)."""

    publisher_id: int
    sequence: int
    published_at: int  # ms since the epoch, set by the publisher
    topic: str
    payload: bytes


def decode_router_event_json(data: bytes | str | dict[str, Any]) -> RouterEvent:
    """One RouterEvent from its JSON text (or an already parsed value): a dump line, a JetStream message.

    A parsed value that is not a map (an item of a JSON list: null, 5, [..]) is a bad_type DecodeError.
    """
    return _router_event(parse_json(data) if isinstance(data, bytes | str) else data)


def decode_router_event_msgpack(data: bytes) -> RouterEvent:
    """One RouterEvent from rmp-serde's named-field msgpack (the event plane's envelope payload)."""
    return _router_event(parse_msgpack(data))


def decode_kv_cache_event(obj_or_json: bytes | str | dict[str, Any], worker_id: int) -> RouterEvent:
    """The inner `{"event_id", "data", "dp_rank"}` object that Dynamo's RadixTree.apply_event takes.

    It carries no storage tier, so its blocks are on the device tier, as in Dynamo.
    """
    obj = obj_or_json if isinstance(obj_or_json, dict) else parse_json(obj_or_json)
    return _kv_cache_event(obj, _uint(worker_id, "worker_id", ErrorKind.bad_type), Tier.device)


def encode_router_event_json(ev: RouterEvent) -> bytes:
    """Dynamo 1.6.1's exact JSON for one RouterEvent (what its dump and JetStream publisher write)."""
    return msgspec.json.encode(_router_event_obj(ev))


def encode_router_event_msgpack(ev: RouterEvent) -> bytes:
    """The named-field msgpack (rmp-serde `to_vec_named`) of one RouterEvent, same shape as the JSON."""
    return msgspec.msgpack.encode(_router_event_obj(ev))


def decode_router_event_batch(data: bytes) -> tuple[list[RouterEvent], list[DecodeError]]:
    """A `kv-events` payload: Dynamo 1.6.1 sends an array of RouterEvents (usually one). A bad event costs
    itself, not its batch: it comes back as a DecodeError with its index. A bare map (one RouterEvent, as
    kvctl published before 1.6.1's layout was known) is read as a batch of one."""
    obj = parse_msgpack(data)
    if isinstance(obj, dict):
        return [_router_event(obj)], []
    if not isinstance(obj, list):
        raise DecodeError(ErrorKind.bad_batch, "kv-events", f"expected an array of RouterEvents, got {describe(obj)}")
    return decode_router_events(obj)


def split_router_event_batch(data: bytes) -> list[msgspec.Raw] | None:
    """A `kv-events` array's events still encoded (only the array itself read: ~30 ms for 100,000), for a caller
    that decodes a large batch a few at a time (`decode_router_event_items`); None when `data` is no array, which
    `decode_router_event_batch` then reads (or refuses) whole."""
    try:
        return msgspec.msgpack.decode(data, type=list[msgspec.Raw])
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):  # nested too deep to skip over
        return None


def decode_router_event_items(raws: Sequence[msgspec.Raw], start: int) -> tuple[list[RouterEvent], list[DecodeError]]:
    """Events `start`.. of a `split_router_event_batch`, as `decode_router_event_batch` decodes them: a bad event
    costs itself (its index counted from the batch's start); one that is no msgpack raises, as it does for the
    whole batch."""
    events, errors = decode_router_events([parse_msgpack(bytes(raw)) for raw in raws])
    return events, [DecodeError(e.kind, e.field, e.detail, None if e.index is None else e.index + start)
                    for e in errors]


def decode_router_events(items: list[Any]) -> tuple[list[RouterEvent], list[DecodeError]]:
    """Decoded RouterEvents (a kv-events batch, a recovery answer's events); a bad one costs itself only."""
    return decode_each(items, _router_event)


def encode_router_event_batch(events: Sequence[RouterEvent]) -> bytes:
    """A `kv-events` payload as Dynamo 1.6.1 publishes it: an array of named-field RouterEvents."""
    return msgspec.msgpack.encode([_router_event_obj(ev) for ev in events])


def decode_envelope(data: bytes) -> EventEnvelope:
    """The event-plane envelope; its payload stays encoded, to be read by the topic's own decoder."""
    obj = _expect_map(parse_msgpack(data), "envelope")
    topic, payload = require(obj, "topic"), require(obj, "payload")
    if not isinstance(topic, str):
        raise DecodeError(ErrorKind.bad_type, "topic", f"expected a string, got {describe(topic)}")
    if not isinstance(payload, bytes):
        raise DecodeError(ErrorKind.bad_type, "payload", f"expected bin, got {describe(payload)}")
    return EventEnvelope(
        publisher_id=_uint(require(obj, "publisher_id"), "publisher_id", ErrorKind.bad_type),
        sequence=_uint(require(obj, "sequence"), "sequence", ErrorKind.bad_type),
        published_at=_uint(require(obj, "published_at"), "published_at", ErrorKind.bad_type),
        topic=topic,
        payload=payload,
    )


def encode_envelope(env: EventEnvelope) -> bytes:
    """The envelope as a named-field msgpack map with `payload` as bin."""
    return msgspec.msgpack.encode(env)


class EnvelopeWriter:
    """One publisher's messages on one topic, as Dynamo numbers them: its own id, `sequence` from 0, +1 each.

    Dynamo gives every (process, topic) a publisher id of its own; a restarted process is a new id.
    """

    __slots__ = ("publisher_id", "sequence", "topic")

    def __init__(self, publisher_id: int, topic: str) -> None:
        self.publisher_id = publisher_id
        self.topic = topic
        self.sequence = 0

    def wrap(self, payload: bytes, now_ms: int) -> bytes:
        envelope = EventEnvelope(self.publisher_id, self.sequence, now_ms, self.topic, payload)
        self.sequence += 1
        return encode_envelope(envelope)

    def restart(self) -> None:
        """The publisher started over (kvctl's mock engines keep their id across a restart): sequence from 0."""
        self.sequence = 0


def _router_event(obj: Any) -> RouterEvent:
    obj = _expect_map(obj, "RouterEvent")
    worker_id = _uint(require(obj, "worker_id"), "worker_id", ErrorKind.bad_type)
    tier = _storage_tier(obj.get("storage_tier", Tier.device.value))
    return _kv_cache_event(require(obj, "event"), worker_id, tier)


def _kv_cache_event(obj: Any, worker_id: int, tier: Tier) -> RouterEvent:
    obj = _expect_map(obj, "event")
    return RouterEvent(
        worker_id=worker_id,
        data=_event_data(require(obj, "data", "event.data"), tier),
        dp_rank=_uint(obj.get("dp_rank", 0), "event.dp_rank", ErrorKind.bad_type, _U32_MAX),
        event_id=_uint(require(obj, "event_id", "event.event_id"), "event.event_id", ErrorKind.bad_type),
    )


def _event_data(data: Any, tier: Tier) -> EventData:
    variant, body = _variant(data)
    if variant == "stored":
        return _stored(_expect_map(body, "event.data.stored"), tier)
    if variant == "removed":
        hashes = require(_expect_map(body, "event.data.removed"), "block_hashes", "removed.block_hashes")
        return Removed(_hash_list(hashes, "removed.block_hashes"), tier)
    if variant == "cleared":
        if body is not None:
            raise DecodeError(ErrorKind.bad_type, "event.data.cleared", f"must be null, got {describe(body)}")
        return Cleared()
    raise DecodeError(ErrorKind.unknown_type, "event.data", f"unknown variant {describe(variant)}")


def _variant(data: Any) -> tuple[Any, Any]:
    """(name, payload) of serde's externally tagged enum: "cleared" is a unit variant, with no payload."""
    if isinstance(data, str):
        return data, None
    if isinstance(data, dict) and len(data) == 1:
        return next(iter(data.items()))
    raise DecodeError(ErrorKind.bad_type, "event.data", f"not a 1-key map or a name: {describe(data)}")


def _stored(body: Mapping[Any, Any], tier: Tier) -> Stored:
    parent = body.get("parent_hash")
    blocks = require(body, "blocks", "stored.blocks")
    if not isinstance(blocks, list):
        raise DecodeError(ErrorKind.bad_type, "stored.blocks", f"expected an array, got {describe(blocks)}")
    block_hashes: list[int] = []
    tokens_hashes: list[int] = []
    for block in blocks:
        block = _expect_map(block, "stored.blocks[]")
        block_hashes.append(_hash(require(block, "block_hash"), "block_hash"))
        tokens_hashes.append(_hash(require(block, "tokens_hash"), "tokens_hash"))
    return Stored(
        parent_hash=None if parent is None else _hash(parent, "parent_hash"),
        block_hashes=block_hashes,
        tokens_hashes=tokens_hashes,
        tier=tier,
    )


def _hash_list(value: Any, field: str) -> list[int]:
    if not isinstance(value, list):
        raise DecodeError(ErrorKind.bad_hash, field, f"expected an array, got {describe(value)}")
    return [_hash(h, field) for h in value]


def _hash(value: Any, field: str) -> int:
    return _uint(value, field, ErrorKind.bad_hash)


def _uint(value: Any, field: str, kind: ErrorKind, maximum: int = _U64_MAX) -> int:
    """An unsigned int as serde reads it: no bools, no floats (even integral ones), no sign bit-cast."""
    if type(value) is int and 0 <= value <= maximum:
        return value
    raise DecodeError(kind, field, f"expected an int in [0, {maximum}], got {describe(value)}")


def _storage_tier(value: Any) -> Tier:
    try:
        return Tier(value)
    except ValueError:
        raise DecodeError(ErrorKind.bad_tier, "storage_tier", f"unknown tier {describe(value)}") from None


def _expect_map(value: Any, field: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise DecodeError(ErrorKind.bad_type, field, f"expected a map, got {describe(value)}")
    return value


def _router_event_obj(ev: RouterEvent) -> dict[str, Any]:
    """The serde shape of a RouterEvent, keys in Dynamo 1.6.1's field order."""
    data = ev.data
    tier = data.tier if isinstance(data, Stored | Removed) else Tier.device
    return {
        "worker_id": ev.worker_id,
        "storage_tier": tier.value,
        "residency_domain": RESIDENCY_DOMAIN,
        "event": {"event_id": ev.event_id, "data": _event_data_obj(data), "dp_rank": ev.dp_rank},
    }


def _event_data_obj(data: EventData) -> Any:
    if isinstance(data, Stored):
        blocks = [
            {"block_hash": b, "tokens_hash": t, "mm_extra_info": None}
            for b, t in zip(data.block_hashes, data.tokens_hashes, strict=True)
        ]
        return {"stored": {"parent_hash": data.parent_hash, "start_position": None, "blocks": blocks}}
    if isinstance(data, Removed):
        return {"removed": {"block_hashes": data.block_hashes}}
    return "cleared"
