"""Dynamo RouterEvent codecs against Dynamo 1.6.1's own output and its own accept/reject decisions."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from kvctl.core.events import (
    Cleared,
    DecodeError,
    ErrorKind,
    EventEnvelope,
    Removed,
    RouterEvent,
    Stored,
    Tier,
    decode_envelope,
    decode_kv_cache_event,
    decode_router_event_json,
    decode_router_event_msgpack,
    encode_envelope,
    encode_router_event_json,
    encode_router_event_msgpack,
)
from kvctl.core.events.dynamo import decode_router_event_batch, split_router_event_batch
from tests.fixtures_path import FIXTURES

DYNAMO = FIXTURES / "dynamo-1.6.1"
DUMP_LINES = (DYNAMO / "dump.jsonl").read_text().splitlines()
APPLIED = [json.loads(line) for line in (DYNAMO / "events_applied.jsonl").read_text().splitlines()]
APPLY_ERRORS = json.loads((DYNAMO / "errors.json").read_text())["apply_event_errors"]

# Dynamo's serde messages -> the kind kvctl reports for the same input.
SERDE_KIND = {
    "expected u64": ErrorKind.bad_hash,
    "expected unit": ErrorKind.bad_type,
    "missing field": ErrorKind.missing_field,
    "unknown variant": ErrorKind.unknown_type,
}


def _serde_kind(error: str) -> ErrorKind:
    (kind,) = [kind for text, kind in SERDE_KIND.items() if text in error]
    return kind


@pytest.mark.parametrize("entry", APPLY_ERRORS, ids=lambda e: e["note"])
def test_errors_json_decisions(entry: dict[str, Any]) -> None:
    """Dynamo's ValueErrors are deserialize errors: kvctl's decoder refuses exactly those.

    Its RuntimeErrors (unknown parent, unknown block, unused dp_rank) are rejections of a
    well-formed event by the index, not the decoder: the event must decode, for the index to refuse.
    """
    if entry["error_type"] == "ValueError":
        assert not entry["accepted"]
        with pytest.raises(DecodeError) as info:
            decode_kv_cache_event(entry["event_json"], entry["worker_id"])
        assert info.value.kind is _serde_kind(entry["error"])
        return
    assert entry["accepted"] == (entry["error_type"] is None)
    wire, ev = _decode_inner(entry["event_json"], entry["worker_id"])
    assert isinstance(ev.data, Stored if "stored" in wire["data"] else Removed)


def _decode_inner(event_json: str, worker_id: int) -> tuple[dict[str, Any], RouterEvent]:
    """Decode a KvCacheEvent line and check the ids it carries came through unchanged."""
    wire = json.loads(event_json)
    ev = decode_kv_cache_event(event_json, worker_id)
    assert (ev.worker_id, ev.event_id, ev.dp_rank) == (worker_id, wire["event_id"], wire.get("dp_rank", 0))
    return wire, ev


def test_stored_without_parent_key_is_accepted() -> None:
    (entry,) = [e for e in APPLY_ERRORS if e["accepted"]]
    ev = decode_kv_cache_event(entry["event_json"], 1)
    assert ev == RouterEvent(1, Stored(None, [1], [2]), dp_rank=0, event_id=15)


@pytest.mark.parametrize("line", DUMP_LINES)
def test_dump_line_round_trips_byte_for_byte(line: str) -> None:
    ev = decode_router_event_json(line)
    assert encode_router_event_json(ev) == line.encode()
    assert decode_router_event_msgpack(encode_router_event_msgpack(ev)) == ev
    assert decode_router_event_json(json.loads(line)) == ev  # an already parsed object


def test_dump_values_are_exact() -> None:
    """Ids above 2^63 and hashes above 2^53 survive as exact ints."""
    first = decode_router_event_json(DUMP_LINES[0])
    assert first.worker_id == 2**63 + 7
    assert first.data == Stored(
        None,
        [6074813335038347851, 1980108668513737630, 2429874279155710269],
        [6074813335038347851, 12165276305097536604, 11486583930170777821],
        Tier.device,
    )
    assert (first.dp_rank, first.event_id) == (0, 0)


@pytest.mark.parametrize("applied", APPLIED, ids=lambda a: f"step{a['step']}")
def test_events_applied_decode(applied: dict[str, Any]) -> None:
    wire, ev = _decode_inner(applied["event_json"], applied["worker_id"])
    data = wire["data"]
    if data == "cleared":
        assert ev.data == Cleared()
    elif "removed" in data:
        assert ev.data == Removed(data["removed"]["block_hashes"])
    else:
        blocks = data["stored"]["blocks"]
        assert ev.data == Stored(
            data["stored"]["parent_hash"],
            [b["block_hash"] for b in blocks],
            [b["tokens_hash"] for b in blocks],
        )


@pytest.mark.parametrize(
    ("ev", "text"),
    [
        (
            RouterEvent(1, Removed([5, 2**64 - 1], Tier.host_pinned), dp_rank=2, event_id=3),
            '{"worker_id":1,"storage_tier":"host_pinned","residency_domain":"worker","event":{"event_id":3,'
            '"data":{"removed":{"block_hashes":[5,18446744073709551615]}},"dp_rank":2}}',
        ),
        (
            RouterEvent(4, Cleared(), event_id=2),
            '{"worker_id":4,"storage_tier":"device","residency_domain":"worker","event":{"event_id":2,'
            '"data":"cleared","dp_rank":0}}',
        ),
        (
            RouterEvent(9, Stored(7, [8], [9], Tier.disk), event_id=1),
            '{"worker_id":9,"storage_tier":"disk","residency_domain":"worker","event":{"event_id":1,"data":'
            '{"stored":{"parent_hash":7,"start_position":null,"blocks":[{"block_hash":8,"tokens_hash":9,'
            '"mm_extra_info":null}]}},"dp_rank":0}}',
        ),
    ],
)
def test_encode_each_variant(ev: RouterEvent, text: str) -> None:
    assert encode_router_event_json(ev) == text.encode()
    assert decode_router_event_json(text) == ev
    assert msgspec.msgpack.decode(encode_router_event_msgpack(ev)) == json.loads(text)


def _router_event(**overrides: Any) -> dict[str, Any]:
    event = {"event_id": 1, "data": {"removed": {"block_hashes": [3]}}}
    return {"worker_id": 5, "event": event} | overrides


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        (_router_event(), RouterEvent(5, Removed([3]), event_id=1)),
        (_router_event(storage_tier="external"), RouterEvent(5, Removed([3], Tier.external), event_id=1)),
        (
            _router_event(residency_domain="elsewhere", future={"x": 1}),
            RouterEvent(5, Removed([3]), event_id=1),
        ),
        (
            _router_event(event={"event_id": 2, "data": {"cleared": None}, "dp_rank": 7}),
            RouterEvent(5, Cleared(), 7, 2),
        ),
        (_router_event(worker_id=2**64 - 1), RouterEvent(2**64 - 1, Removed([3]), event_id=1)),
    ],
)
def test_router_event_json_accepts(obj: dict[str, Any], expected: RouterEvent) -> None:
    assert decode_router_event_json(obj) == expected
    assert decode_router_event_json(msgspec.json.encode(obj)) == expected
    assert decode_router_event_json(msgspec.json.encode(obj).decode()) == expected
    assert decode_router_event_msgpack(msgspec.msgpack.encode(obj)) == expected


def _stored_event(**block: Any) -> dict[str, Any]:
    return {
        "event_id": 1,
        "data": {"stored": {"parent_hash": None, "blocks": [{"block_hash": 1, "tokens_hash": 2} | block]}},
    }


@pytest.mark.parametrize(
    ("payload", "kind", "field"),
    [
        (b"{", ErrorKind.bad_json, "payload"),
        (b"[" * 5000, ErrorKind.bad_json, "payload"),
        (b"[]", ErrorKind.bad_type, "RouterEvent"),
        (_router_event(worker_id=-5), ErrorKind.bad_type, "worker_id"),
        (_router_event(worker_id=True), ErrorKind.bad_type, "worker_id"),
        ({"event": _router_event()["event"]}, ErrorKind.missing_field, "worker_id"),
        (_router_event(event=None), ErrorKind.bad_type, "event"),
        ({"worker_id": 5}, ErrorKind.missing_field, "event"),
        (_router_event(storage_tier="gpu"), ErrorKind.bad_tier, "storage_tier"),
        (_router_event(storage_tier=None), ErrorKind.bad_tier, "storage_tier"),
        (
            _router_event(event={"event_id": 1, "data": "cleared", "dp_rank": 2**32}),
            ErrorKind.bad_type,
            "event.dp_rank",
        ),
        (_router_event(event={"event_id": 1.0, "data": "cleared"}), ErrorKind.bad_type, "event.event_id"),
        (_router_event(event={"event_id": 1}), ErrorKind.missing_field, "event.data"),
        (_router_event(event={"event_id": 1, "data": "stored"}), ErrorKind.bad_type, "event.data.stored"),
        (_router_event(event={"event_id": 1, "data": "bogus"}), ErrorKind.unknown_type, "event.data"),
        (_router_event(event={"event_id": 1, "data": {}}), ErrorKind.bad_type, "event.data"),
        (
            _router_event(event={"event_id": 1, "data": {"cleared": None, "stored": {}}}),
            ErrorKind.bad_type,
            "event.data",
        ),
        (
            _router_event(event={"event_id": 1, "data": {"removed": {}}}),
            ErrorKind.missing_field,
            "removed.block_hashes",
        ),
        (
            _router_event(event={"event_id": 1, "data": {"removed": {"block_hashes": [-1]}}}),
            ErrorKind.bad_hash,
            "removed.block_hashes",
        ),
        (
            _router_event(event={"event_id": 1, "data": {"stored": {"parent_hash": None}}}),
            ErrorKind.missing_field,
            "stored.blocks",
        ),
        (
            _router_event(event={"event_id": 1, "data": {"stored": {"blocks": {}}}}),
            ErrorKind.bad_type,
            "stored.blocks",
        ),
        (
            _router_event(event={"event_id": 1, "data": {"stored": {"blocks": [7]}}}),
            ErrorKind.bad_type,
            "stored.blocks[]",
        ),
        (
            _router_event(event=_stored_event(block_hash=1.8446744073709552e19)),
            ErrorKind.bad_hash,
            "block_hash",
        ),
        (_router_event(event=_stored_event(tokens_hash="2")), ErrorKind.bad_hash, "tokens_hash"),
        (_router_event(event=_stored_event(tokens_hash=2**64)), ErrorKind.bad_hash, "tokens_hash"),
        (
            _router_event(event={"event_id": 1, "data": {"stored": {"parent_hash": -1, "blocks": []}}}),
            ErrorKind.bad_hash,
            "parent_hash",
        ),
    ],
)
def test_router_event_json_rejects(payload: Any, kind: ErrorKind, field: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode_router_event_json(payload)
    assert (info.value.kind, info.value.field, info.value.index) == (kind, field, None)
    assert field in str(info.value)


def test_decode_kv_cache_event_checks_worker_id() -> None:
    with pytest.raises(DecodeError) as info:
        decode_kv_cache_event('{"event_id":1,"data":"cleared"}', -1)
    assert info.value.kind is ErrorKind.bad_type


# --- event-plane envelope ---------------------------------------------------------------------------


def test_envelope_round_trip_carries_a_router_event() -> None:
    ev = decode_router_event_json(DUMP_LINES[0])
    env = EventEnvelope(2**63 + 7, 41, 1_795_312_301_289, "kv-events", encode_router_event_msgpack(ev))
    wire = encode_envelope(env)
    # A named-field map with payload as bin, as rmp_serde::to_vec_named writes it.
    assert msgspec.msgpack.decode(wire) == {
        "publisher_id": 2**63 + 7,
        "sequence": 41,
        "published_at": 1_795_312_301_289,
        "topic": "kv-events",
        "payload": env.payload,
    }
    assert wire[:1] == b"\x85"  # a map of 5 (decoding the payload back as bytes shows it is bin, not str)
    decoded = decode_envelope(wire)
    assert decoded == env
    assert decode_router_event_msgpack(decoded.payload) == ev


def _envelope(**overrides: Any) -> bytes:
    env = {"publisher_id": 1, "sequence": 2, "published_at": 3, "topic": "kv-events", "payload": b"\x80"}
    return msgspec.msgpack.encode(env | overrides)


def test_envelope_ignores_unknown_keys() -> None:
    assert decode_envelope(_envelope(future=[1, 2])) == EventEnvelope(1, 2, 3, "kv-events", b"\x80")


@pytest.mark.parametrize(
    ("wire", "kind", "field"),
    [
        (b"\xc1", ErrorKind.bad_msgpack, "payload"),
        (msgspec.msgpack.encode([1, 2, 3, "t", b""]), ErrorKind.bad_type, "envelope"),
        (_envelope(sequence=-1), ErrorKind.bad_type, "sequence"),
        (_envelope(published_at=1.5), ErrorKind.bad_type, "published_at"),
        (_envelope(topic=b"kv-events"), ErrorKind.bad_type, "topic"),
        (_envelope(payload="not bin"), ErrorKind.bad_type, "payload"),
        (
            msgspec.msgpack.encode({"sequence": 2, "published_at": 3, "topic": "t", "payload": b""}),
            ErrorKind.missing_field,
            "publisher_id",
        ),
    ],
)
def test_envelope_rejects(wire: bytes, kind: ErrorKind, field: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode_envelope(wire)
    assert (info.value.kind, info.value.field) == (kind, field)


def test_a_batch_nested_too_deep_is_refused_not_raised() -> None:
    """msgspec raises RecursionError (no DecodeError) on 200,000 nested arrays: the large-batch splitter must hand
    such a payload to the whole-batch decoder, which refuses it as bad msgpack, not let it kill the ingest loop."""
    deep = b"\x91" * 200_000 + b"\xc0"
    assert split_router_event_batch(deep) is None
    with pytest.raises(DecodeError) as caught:
        decode_router_event_batch(deep)
    assert caught.value.kind is ErrorKind.bad_msgpack
