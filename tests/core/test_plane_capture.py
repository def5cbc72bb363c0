"""Dynamo 1.6.1's NATS event plane as a running fleet put it on the wire (tests/fixtures/dynamo-1.6.1-fleet):
every captured message is routed by its subject, its envelope and payload decode, and kvctl's encoders give
back the same bytes, so what kvctl publishes is what Dynamo publishes."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvctl.core.events import DecodeError, ErrorKind, Stored
from kvctl.core.events.dynamo import (
    EnvelopeWriter,
    decode_envelope,
    decode_router_event_batch,
    encode_envelope,
    encode_router_event_batch,
    encode_router_event_msgpack,
)
from kvctl.core.events.plane import (
    ACTIVE_SEQUENCES,
    FORWARD_PASS,
    KV_EVENTS,
    KV_METRICS,
    PlaneNames,
    PlaneScope,
    decode_active_load,
    decode_forward_pass,
    decode_sequence_event,
    encode_active_load,
    encode_forward_pass,
    encode_sequence_event,
)
from kvctl.core.events.publishers import JUMP_MAX, REDELIVERY_MAX, Numbering, Order, PublisherBook
from tests.fixtures_path import FIXTURES

CAPTURE_FILE = FIXTURES / "dynamo-1.6.1-fleet" / "nats_capture.jsonl"
CAPTURE = [json.loads(line) for line in CAPTURE_FILE.read_text().splitlines()]
CODECS: dict[str, tuple[Any, Any]] = {
    KV_METRICS: (decode_active_load, encode_active_load),
    ACTIVE_SEQUENCES: (decode_sequence_event, encode_sequence_event),
    FORWARD_PASS: (decode_forward_pass, encode_forward_pass),
}


def test_every_captured_subject_is_in_the_namespace_scope_and_names_its_topic() -> None:
    scope = PlaneScope("dynamo")
    topics: Counter[str] = Counter()
    for msg in CAPTURE:
        where = scope.match(msg["subject"])
        assert where is not None and where[:2] == ("backend", "generate")
        assert PlaneNames("dynamo").subject(where[2]) == msg["subject"]
        topics[where[2]] += 1
    assert set(topics) == {KV_EVENTS, KV_METRICS, ACTIVE_SEQUENCES, FORWARD_PASS}
    assert PlaneScope("dynamo", "prefill").match(CAPTURE[0]["subject"]) is None
    assert PlaneScope("dynamo", None, "clear").match(CAPTURE[0]["subject"]) is None
    assert PlaneScope("other").match(CAPTURE[0]["subject"]) is None
    assert PlaneScope("dynamo").match("namespace.dynamo.component.backend.kv-events") is None  # pre-1.6 layout


@pytest.mark.parametrize("msg", CAPTURE, ids=lambda m: m["subject"].rsplit(".", 1)[1])
def test_each_captured_message_decodes_and_encodes_back_to_its_bytes(msg: dict[str, str]) -> None:
    body = bytes.fromhex(msg["hex"])
    envelope = decode_envelope(body)
    assert encode_envelope(envelope) == body
    topic = msg["subject"].rsplit(".", 1)[1]
    assert envelope.topic == topic
    if topic == KV_EVENTS:
        events, errors = decode_router_event_batch(envelope.payload)
        assert errors == [] and events and all(isinstance(ev.data, Stored) for ev in events)
        assert encode_router_event_batch(events) == envelope.payload
        return
    decode, encode = CODECS[topic]
    assert encode(decode(envelope.payload)) == envelope.payload


def test_a_forward_pass_reads_its_string_worker_id_and_its_counts() -> None:
    reports = [decode_forward_pass(decode_envelope(bytes.fromhex(m["hex"])).payload)
               for m in CAPTURE if m["subject"].endswith(FORWARD_PASS)]
    assert {r.worker_id for r in reports} == {5237527487617185523, 10772273237181726984}  # > 2^63: a u64
    busy = [r for r in reports if r.scheduled.prefill_requests]
    assert busy and all(r.scheduled.prefill_tokens > 0 and r.scheduled.prefill_kv_tokens is not None for r in busy)
    assert all(r.queued.prefill_kv_tokens is None for r in reports)  # queued requests carry no cached count


def test_a_bad_event_costs_itself_not_its_batch() -> None:
    good = decode_router_event_batch(decode_envelope(bytes.fromhex(next(
        m["hex"] for m in CAPTURE if m["subject"].endswith(KV_EVENTS)))).payload)[0][0]
    raw = msgspec.msgpack.decode(encode_router_event_batch([good]))[0]
    bad = {**raw, "worker_id": -1}
    events, errors = decode_router_event_batch(msgspec.msgpack.encode([bad, raw, "x"]))
    assert events == [good]
    assert [(e.index, e.kind) for e in errors] == [(0, ErrorKind.bad_type), (2, ErrorKind.bad_type)]
    assert decode_router_event_batch(encode_router_event_msgpack(good)) == ([good], [])  # a bare map: one event
    with pytest.raises(DecodeError) as exc:
        decode_router_event_batch(msgspec.msgpack.encode(7))
    assert exc.value.kind is ErrorKind.bad_batch


def test_the_envelope_writer_numbers_from_0_and_starts_over_on_restart() -> None:
    writer = EnvelopeWriter(41, KV_METRICS)
    sent = [decode_envelope(writer.wrap(b"\x90", 1000 + n)) for n in range(3)]
    assert [(e.publisher_id, e.sequence, e.topic, e.published_at) for e in sent] == [
        (41, 0, KV_METRICS, 1000), (41, 1, KV_METRICS, 1001), (41, 2, KV_METRICS, 1002)]
    writer.restart()
    assert decode_envelope(writer.wrap(b"\x90", 0)).sequence == 0


# ----- per-publisher order: PublisherBook against a model of docs/contract.md's rule --------------------------

@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 12)), max_size=60))
def test_publisher_order_follows_the_rule(messages: list[tuple[int, int]]) -> None:
    book = PublisherBook()
    last: dict[int, int] = {}
    lost: Counter[int] = Counter()
    for n, (pid, seq) in enumerate(messages):
        order, pub = book.observe(pid, seq, float(n), KV_EVENTS, "backend", "generate")
        before = last.get(pid)
        expected = (Order.first if before is None else Order.repeat if seq == before
                    else Order.restart if seq < before else Order.gap if seq > before + 1 else Order.next)
        assert order is expected
        if expected is Order.gap:
            assert before is not None
            lost[pid] += seq - before - 1
        last[pid] = seq
        assert pub.sequence.last == seq and pub.sequence.lost == lost[pid] and pub.last_seen == float(n)
    assert book.totals()["publishers"] == len(last)


_NUMBERS = st.one_of(st.integers(0, 12), st.integers(JUMP_MAX - 2, JUMP_MAX + 14),
                     st.integers(REDELIVERY_MAX - 2, REDELIVERY_MAX + 14), st.integers(2**63 - 2, 2**64 - 1))


@given(st.lists(_NUMBERS, max_size=40), st.sampled_from([(False, False), (True, False), (False, True)]))
def test_every_number_has_one_place_and_none_freezes_the_sequence(numbers: list[int],
                                                                  transport: tuple[bool, bool]) -> None:
    """The rules against a model that states them as ranges around the position: a jump (an anomaly) keeps the
    position, so a number right after the position is always next, whatever came before it."""
    redelivered, once = transport
    sequence = Numbering(redelivered=redelivered, once=once)
    at: int | None = None
    counted: Counter[Order] = Counter()
    lost = 0
    for number in numbers:
        order = sequence.observe(number)
        if at is None:
            expected, moves = Order.first, True
        else:
            back = at - number
            if (back == 0 and not once) or (redelivered and number > 1 and 0 < back <= REDELIVERY_MAX):
                expected, moves = Order.repeat, False
            elif back >= 0:
                expected, moves = Order.restart, True
            elif -back == 1:
                expected, moves = Order.next, True
            elif -back - 1 <= JUMP_MAX:
                expected, moves, lost = Order.gap, True, lost - back - 1
            else:
                expected, moves = Order.jump, False
        assert order is expected, (at, number)
        counted[order] += 1
        at = number if moves else at
        assert sequence.last == at
    assert sequence.counts() == {"gaps": counted[Order.gap], "lost": lost, "restarts": counted[Order.restart],
                                 "repeats": counted[Order.repeat], "jumps": counted[Order.jump]}
    assert sequence.lost <= JUMP_MAX * sequence.gaps  # never 2^64 messages lost in one gap
    if at is not None:
        assert sequence.observe(at + 1) is Order.next


def test_an_absurd_number_is_a_jump_and_the_next_one_is_in_order() -> None:
    """Once, an event id of 2^63 moved the position there and every later event was dropped as old; a seq of
    2^64 - 1 counted 2^64 lost batches."""
    sequence = Numbering(redelivered=True)
    assert [sequence.observe(n) for n in (1, 2, 2**63, 3, 2**64 - 1, 4, 1)] == [
        Order.first, Order.next, Order.jump, Order.next, Order.jump, Order.next, Order.restart]
    assert (sequence.jumps, sequence.lost, sequence.last) == (2, 0, 1)


def test_the_book_forgets_the_publisher_heard_from_longest_ago() -> None:
    book = PublisherBook(limit=2)
    book.observe(1, 0, 0.0, KV_EVENTS, "backend", "generate")
    book.observe(2, 0, 1.0, KV_EVENTS, "backend", "generate")
    book.observe(1, 1, 2.0, KV_EVENTS, "backend", "generate")
    book.observe(3, 0, 3.0, KV_EVENTS, "backend", "generate")
    assert sorted(book.publishers) == [1, 3]
