"""Dynamo 1.6.1's ZMQ event plane as running fleets put it on the wire and in discovery
(tests/fixtures/dynamo-1.6.1-fleet/zmq-plane): every captured message's four frames decode, agree with the
envelope inside and re-encode to the same bytes; every topic's payload decodes (`active_sequences_events` as a
`{"events": [...]}` batch, re-encoded byte for byte); every discovery record and file name parses and names the
publisher whose messages were captured from it. Malformed shapes are DecodeErrors of stable kinds."""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvctl.core.events import DecodeError, ErrorKind
from kvctl.core.events.discovery import (
    ChannelKey,
    decode_file_name,
    encode_file_name,
    namespace_prefix,
    parse_channel_key,
    parse_event_channel,
)
from kvctl.core.events.dynamo import decode_envelope, decode_router_event_batch
from kvctl.core.events.plane import (
    ACTIVE_SEQUENCES,
    FORWARD_PASS,
    KV_EVENTS,
    KV_METRICS,
    TOPICS,
    ActiveSequenceEvent,
    AddRequest,
    decode_active_load,
    decode_forward_pass,
    decode_sequence_events,
    encode_sequence_event,
    encode_sequence_events,
    sequence_event_obj,
    sequence_event_of,
)
from kvctl.core.events.zmq_wire import ZmqMessage, decode_zmq_message, encode_zmq_message
from tests.fixtures_path import FIXTURES
from tests.support.records import DROP, rewritten

ZMQ = FIXTURES / "dynamo-1.6.1-fleet" / "zmq-plane"
CAPTURES = ("zmq_capture.jsonl", "zmq_capture_replica.jsonl", "zmq_capture_restart.jsonl")
CHANNELS = ZMQ / "file-discovery" / "v1" / "event_channels"


def rows(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (ZMQ / name).read_text().splitlines()]


def frames(row: dict[str, Any]) -> list[bytes]:
    return [bytes.fromhex(f) for f in row["frames_hex"]]


ALL = [row for name in CAPTURES for row in rows(name)]


def test_every_captured_message_decodes_and_reencodes_byte_for_byte() -> None:
    topics: Counter[str] = Counter()
    for row in ALL:
        message = decode_zmq_message(frames(row))
        assert encode_zmq_message(message) == frames(row)
        envelope = decode_envelope(message.envelope)
        # the frames repeat what the envelope says, and the publisher is the discovery record's instance
        assert (envelope.topic, envelope.publisher_id, envelope.sequence) == (message.topic, message.publisher_id,
                                                                               message.sequence)
        assert message.topic == row["discovery_topic"] and message.publisher_id == row["discovery_instance_id"]
        topics[message.topic] += 1
    assert set(topics) == set(TOPICS), topics


def test_every_topics_payload_decodes_and_sequence_batches_reencode() -> None:
    decoded: Counter[str] = Counter()
    for row in ALL:
        message = decode_zmq_message(frames(row))
        payload = decode_envelope(message.envelope).payload
        if message.topic == KV_EVENTS:
            events, errors = decode_router_event_batch(payload)
            assert events and not errors
        elif message.topic == KV_METRICS:
            decode_active_load(payload)
        elif message.topic == FORWARD_PASS:
            decode_forward_pass(payload)
        else:
            assert message.topic == ACTIVE_SEQUENCES
            assert set(msgspec.msgpack.decode(payload)) == {"events"}  # inside the envelope's payload
            events, errors = decode_sequence_events(payload)
            assert events and not errors
            assert encode_sequence_events(events) == payload
        decoded[message.topic] += 1
    assert decoded[ACTIVE_SEQUENCES] > 10 and decoded[KV_EVENTS] > 10


def test_sequences_follow_per_publisher_and_a_restart_is_a_new_identity() -> None:
    first: dict[int, tuple[str, int, list[int]]] = {}
    last: dict[int, int] = {}
    for row in rows("zmq_capture_restart.jsonl"):
        message = decode_zmq_message(frames(row))
        if message.publisher_id in last:
            assert message.sequence == last[message.publisher_id] + 1  # nothing lost on loopback
        else:
            payload = decode_envelope(message.envelope).payload
            ids = [e.event_id for e in decode_router_event_batch(payload)[0]] if message.topic == KV_EVENTS else []
            first[message.publisher_id] = (message.topic, message.sequence, ids)
        last[message.publisher_id] = message.sequence
    # the restarted worker: four new publishers, one per topic, each from sequence 0, its event ids from 1
    new = {topic: ids for topic, sequence, ids in first.values() if sequence == 0}
    assert set(new) == set(TOPICS) and new[KV_EVENTS] == [1], first


def test_a_bare_sequence_event_is_a_batch_of_one_and_bad_events_cost_themselves() -> None:
    event = ActiveSequenceEvent("r1", 7, 0, "Free", 9)
    assert decode_sequence_events(encode_sequence_event(event)) == ([event], [])
    batch = msgspec.msgpack.encode({"events": [msgspec.Raw(encode_sequence_event(event)), {"request_id": 5}]})
    events, errors = decode_sequence_events(batch)
    assert events == [event] and [(e.kind, e.index) for e in errors] == [(ErrorKind.bad_type, 1)]
    with pytest.raises(DecodeError) as exc:
        decode_sequence_events(msgspec.msgpack.encode({"events": {"a": 1}}))
    assert exc.value.kind is ErrorKind.bad_batch


def test_every_captured_decision_keeps_itself_as_a_recordings_json() -> None:
    """`events record --decisions` writes each decision as serde's JSON of the map replica sync sends as msgpack:
    the captured maps, key for key, through JSON and back (u64 hashes and ids past 2^53 exact)."""
    heard = 0
    for row in ALL:
        message = decode_zmq_message(frames(row))
        if message.topic != ACTIVE_SEQUENCES:
            continue
        payload = decode_envelope(message.envelope).payload
        for wire, event in zip(msgspec.msgpack.decode(payload)["events"], decode_sequence_events(payload)[0],
                               strict=True):
            line = json.dumps({"timestamp": 1, "decision": sequence_event_obj(event)})
            assert json.loads(line)["decision"] == wire  # what Dynamo sent, field for field
            assert sequence_event_of(json.loads(line)["decision"]) == event
            heard += isinstance(event.action, AddRequest)
    assert heard >= 10


_U64S = st.integers(0, 2**64 - 1)
_ACTIONS = st.one_of(st.sampled_from(["Free", "MarkPrefillCompleted"]), st.builds(
    AddRequest, st.none() | st.lists(_U64S, max_size=8), st.booleans(), st.none() | st.integers(0, 2**32 - 1),
    st.none() | _U64S))


@given(st.builds(ActiveSequenceEvent, st.text(max_size=20), _U64S, st.integers(0, 2**32 - 1), _ACTIONS, _U64S,
                 st.none() | st.text(max_size=8)))
def test_a_decision_round_trips_through_json_and_msgpack_alike(event: ActiveSequenceEvent) -> None:
    obj = sequence_event_obj(event)
    assert sequence_event_of(json.loads(json.dumps(obj))) == event
    assert decode_sequence_events(encode_sequence_event(event)) == ([event], [])


GOOD = frames(ALL[0])


@pytest.mark.parametrize(("shape", "kind", "field"), [
    (GOOD[:3], ErrorKind.bad_batch, "frames"),
    ([*GOOD, b""], ErrorKind.bad_batch, "frames"),
    ([b"", *GOOD[1:]], ErrorKind.bad_type, "frames.topic"),
    (["kv-évents".encode(), *GOOD[1:]], ErrorKind.bad_type, "frames.topic"),
    ([GOOD[0], GOOD[1][:7], *GOOD[2:]], ErrorKind.bad_batch, "frames.publisher_id"),
    ([*GOOD[:2], GOOD[2] + b"\0", GOOD[3]], ErrorKind.bad_batch, "frames.sequence"),
    ([*GOOD[:3], GOOD[3][:4]], ErrorKind.bad_batch, "frames.envelope"),
    ([*GOOD[:3], b"\x02" + GOOD[3][1:]], ErrorKind.unknown_type, "frames.envelope.version"),
    ([*GOOD[:3], GOOD[3][:-1]], ErrorKind.bad_batch, "frames.envelope.length"),
    ([*GOOD[:3], GOOD[3] + b"\0"], ErrorKind.bad_batch, "frames.envelope.length"),
])
def test_malformed_frames_are_decode_errors_of_a_stable_kind(shape: list[bytes], kind: ErrorKind, field: str) -> None:
    with pytest.raises(DecodeError) as exc:
        decode_zmq_message(shape)
    assert (exc.value.kind, exc.value.field) == (kind, field)


def test_an_empty_envelope_is_framed_like_any_other() -> None:
    message = ZmqMessage("kv-events", 2**64 - 1, 0, b"")
    assert decode_zmq_message(encode_zmq_message(message)) == message


# ----- discovery -------------------------------------------------------------------------------------------

def test_every_file_discovery_record_parses_and_its_file_name_is_its_key() -> None:
    paths = sorted(CHANNELS.iterdir())
    assert len(paths) == 10
    captured = {(r["discovery_topic"], r["discovery_instance_id"]): r["endpoint"] for r in ALL}
    matched = 0
    for path in paths:
        key = decode_file_name(path.name)
        assert encode_file_name(key) == path.name
        channel = parse_event_channel(path.read_bytes())
        assert parse_channel_key(key) == channel.key
        assert channel.key.key == f"v1/event_channels/{key}"
        assert (channel.namespace, channel.component, channel.endpoint) == ("dynamo", "backend", "generate")
        assert channel.address.startswith("tcp://") and channel.topic in TOPICS
        if (channel.topic, channel.publisher_id) in captured:
            assert captured[(channel.topic, channel.publisher_id)] == channel.address
            matched += 1
    assert matched >= 4


def test_the_file_backend_escapes_everything_but_letters_and_digits() -> None:
    name = next(p.name for p in CHANNELS.iterdir() if "kv%5Fmetrics" in p.name)
    assert name.startswith("namespace%2Fdynamo%2Fcomponent%2Fbackend%2Fendpoint%2Fgenerate%2Ftopic%2Fkv%5Fmetrics%2F")
    assert encode_file_name("a-b_c.d/é") == "a%2Db%5Fc%2Ed%2F%C3%A9"
    assert decode_file_name("a%2Db%5Fc%2Ed%2F%C3%A9") == "a-b_c.d/é"
    for stray in ("a-b", "x%2", "x%2d", "%FF", ".namespace%2Fx.swp"):
        with pytest.raises(DecodeError) as exc:
            decode_file_name(stray)
        assert exc.value.kind is ErrorKind.bad_type


def test_the_etcd_records_are_the_same_values() -> None:
    channels = [parse_event_channel(line) for line in (ZMQ / "etcd_event_channels.jsonl").read_text().splitlines()]
    assert len(channels) == 9 and {c.topic for c in channels} == set(TOPICS)
    key = ChannelKey("dynamo", "backend", "generate", "kv-events", 0x147411CCD70FF7)
    assert key.key == ("v1/event_channels/namespace/dynamo/component/backend/endpoint/generate/topic/kv-events/"
                       "147411ccd70ff7")
    assert parse_channel_key(key.key) == key and key.key.startswith(namespace_prefix("dynamo"))


def _record(**changes: Any) -> bytes:
    return rewritten(next(CHANNELS.iterdir()).read_text(), **changes)


@pytest.mark.parametrize(("record", "kind"), [
    (b"{", ErrorKind.bad_json),
    (b"[]", ErrorKind.bad_type),
    (_record(type="EventSource"), ErrorKind.unknown_type),
    (_record(scope__kind="component"), ErrorKind.unknown_type),
    (_record(transport__kind="Nats"), ErrorKind.unknown_type),
    (_record(transport__config__endpoint="ipc:///tmp/x"), ErrorKind.bad_type),
    (_record(instance_id=-1), ErrorKind.bad_type),
    (_record(instance_id="12"), ErrorKind.bad_type),
    (_record(instance_id=DROP), ErrorKind.missing_field),
    (_record(topic=DROP), ErrorKind.missing_field),
    (_record(scope__endpoint__name=""), ErrorKind.bad_type),
])
def test_malformed_records_are_decode_errors_of_a_stable_kind(record: bytes, kind: ErrorKind) -> None:
    with pytest.raises(DecodeError) as exc:
        parse_event_channel(record)
    assert exc.value.kind is kind


@pytest.mark.parametrize("key", [
    "v1/event_channels/namespace/dynamo/component/backend/endpoint/generate/topic/kv-events",
    "v1/event_channels/namespace/dynamo/component/backend/endpoint/generate/topic/kv-events/XYZ",
    "v1/event_channels/namespace/dynamo/component/backend/topic/kv-events/abc",
    "v1/event_channels/namespace/dynamo/component/backend/endpoint/generate/topic/kv-events/12345678901234567",
])
def test_keys_of_another_layout_are_refused(key: str) -> None:
    with pytest.raises(DecodeError):
        parse_channel_key(key)


@given(st.lists(st.binary(max_size=64), max_size=6))
def test_any_frames_decode_or_raise_a_decode_error(shape: list[bytes]) -> None:
    try:
        message = decode_zmq_message(shape)
    except DecodeError:
        return
    assert encode_zmq_message(message) == shape


@given(st.one_of(st.binary(max_size=200), st.text(max_size=200)))
def test_any_record_or_file_name_parses_or_raises_a_decode_error(data: bytes | str) -> None:
    with contextlib.suppress(DecodeError):
        parse_event_channel(data)
    if isinstance(data, str):
        with contextlib.suppress(DecodeError):
            assert encode_file_name(decode_file_name(data)) == data
        with contextlib.suppress(DecodeError):
            parse_channel_key(data)


@given(st.text(max_size=60))
def test_every_key_round_trips_through_its_file_name(key: str) -> None:
    assert decode_file_name(encode_file_name(key)) == key
