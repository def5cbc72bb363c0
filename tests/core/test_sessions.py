"""Session affinity: the bindings a 1.6.1 frontend publishes (captured, tests/fixtures/dynamo-1.6.1-fleet/zmq-plane)
and the book that keeps them, per worker set, with Dynamo's idle TTL and bound."""

from __future__ import annotations

import json
import math

import msgspec
import pytest

from kvctl.core.events import DecodeError, ErrorKind
from kvctl.core.events.dynamo import decode_envelope
from kvctl.core.events.session_affinity import SESSION_AFFINITY, decode_session_binding
from kvctl.core.events.zmq_wire import decode_zmq_message
from kvctl.core.names import Role
from kvctl.core.router.sessions import SessionBook
from tests.fixtures_path import FIXTURES

CAPTURE = FIXTURES / "dynamo-1.6.1-fleet" / "zmq-plane" / "zmq_capture_session_affinity.jsonl"
A, B = (1, 0), (2, 0)


def _payloads() -> list[bytes]:
    out = []
    for line in CAPTURE.read_text().splitlines():
        message = decode_zmq_message([bytes.fromhex(f) for f in json.loads(line)["frames_hex"]])
        assert message.topic == SESSION_AFFINITY
        out.append(decode_envelope(message.envelope).payload)
    return out


def test_the_captured_bindings_decode_two_per_request() -> None:
    bindings = [decode_session_binding(p) for p in _payloads()]
    assert [b.session_id for b in bindings] == ["sess-A"] * 4 + ["sess-B"] * 2
    assert len({b.writer_id for b in bindings}) == 1 and bindings[0].worker[1] == 0
    a, b = bindings[0], bindings[-1]
    assert b.sequence == a.sequence + 1  # a new session's version follows the last one's


@pytest.mark.parametrize(("change", "kind"), [({"session_id": ""}, ErrorKind.bad_type),
                                              ({"session_id": "x" * 1025}, ErrorKind.bad_type),
                                              ({"worker_id": -1}, ErrorKind.bad_type),
                                              ({"sequence": None}, ErrorKind.bad_type)])
def test_a_malformed_binding_is_a_decode_error_naming_its_field(change: dict, kind: ErrorKind) -> None:
    obj = {**msgspec.msgpack.decode(_payloads()[0]), **change}
    with pytest.raises(DecodeError) as caught:
        decode_session_binding(msgspec.msgpack.encode(obj))
    assert caught.value.kind is kind and caught.value.field == next(iter(change))


def test_a_binding_lives_its_idle_ttl_from_its_last_use() -> None:
    book = SessionBook(30)
    book.bind(Role.aggregated, "s", A, now=0.0, sequence=5)
    assert book.pinned(Role.aggregated, "s", now=29.0) == A  # a use refreshes it
    assert book.pinned(Role.aggregated, "s", now=58.0) == A
    assert book.pinned(Role.aggregated, "s", now=88.0) is None and len(book) == 0


def test_a_late_frontend_binding_changes_nothing_and_this_routers_own_always_wins() -> None:
    book = SessionBook(30)
    book.bind(Role.aggregated, "s", A, now=0.0, sequence=5)
    book.bind(Role.aggregated, "s", B, now=1.0, sequence=4)
    assert book.pinned(Role.aggregated, "s", now=2.0) == A
    book.bind(Role.aggregated, "s", B, now=3.0)
    assert book.pinned(Role.aggregated, "s", now=4.0) == B


def test_prefill_and_the_models_own_worker_set_pin_apart() -> None:
    book = SessionBook(30)
    book.bind(Role.prefill, "s", A, now=0.0)
    book.bind(Role.decode, "s", B, now=0.0)
    assert (book.pinned(Role.prefill, "s", 1.0), book.pinned(Role.decode, "s", 1.0),
            book.pinned(Role.aggregated, "s", 1.0)) == (A, B, B)  # decode workers are the model's own set


def test_past_its_bound_the_least_recently_used_goes_first_and_is_counted() -> None:
    book = SessionBook(30, max_entries=2)
    for n, session in enumerate(("a", "b", "c")):
        book.bind(Role.aggregated, session, A, now=float(n))
        if session == "b":
            book.pinned(Role.aggregated, "a", now=1.5)  # "a" used: "b" is now the least recent
    assert [book.pinned(Role.aggregated, s, now=3.0) for s in ("a", "b", "c")] == [A, None, A]
    assert book.evicted == 1
    assert book.expire(now=100.0) == 2 and len(book) == 0


@pytest.mark.parametrize("ttl", [0.5, 31_536_001, math.nan, True])
def test_the_ttl_is_dynamos_one_second_to_a_year(ttl: float) -> None:
    with pytest.raises(ValueError, match="session affinity TTL"):
        SessionBook(ttl)
