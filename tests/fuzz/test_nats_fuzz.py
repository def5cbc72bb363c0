"""Hostile payloads on the NATS event plane: the decoders `kvctl serve --nats` runs on each subject, then a real
nats-server carrying junk on every subject the plane follows.

The envelope alone and RouterEvent JSON are fuzzed in tests/core/test_events_fuzz.py; here: the envelope's
RouterEvent msgpack payload, the two decoded together as `_on_core_event` does, load reports and replica-sync
events. Only `DecodeError` may come out, and it must name the field.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import nats
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvctl.core.events import DecodeError, ErrorKind, RouterEvent, Stored
from kvctl.core.events.dynamo import (
    EventEnvelope,
    decode_envelope,
    decode_router_event_json,
    decode_router_event_msgpack,
    encode_envelope,
    encode_router_event_json,
    encode_router_event_msgpack,
)
from kvctl.core.events.plane import (
    ActiveLoad,
    ActiveSequenceEvent,
    AddRequest,
    PlaneNames,
    decode_active_load,
    decode_sequence_event,
    encode_active_load,
    encode_sequence_event,
)
from kvctl.core.hashing import local_block_hashes, sequence_hashes
from kvctl.nats_barrier import barrier
from kvctl.natsconn import NatsConnection
from kvctl.server.nats_plane import EventPlane, NatsOptions
from kvctl.server.state import Fleet
from kvctl.server.streams import Streams
from tests.fixtures_path import FIXTURES
from tests.fuzz.junk import DEPTHS, JSON_JUNK, MSGPACK_JUNK, U64, Blob, deep_json, deep_msgpack, hostile
from tests.nats_server import NatsServer

DUMP = [decode_router_event_json(line) for line in (FIXTURES / "dynamo-1.6.1" / "dump.jsonl").read_text().splitlines()]
ROUTER_EVENTS = [encode_router_event_msgpack(ev) for ev in DUMP]
ENVELOPES = [encode_envelope(EventEnvelope(7, n, 1_795_312_301_289, "kv-events", p))
             for n, p in enumerate(ROUTER_EVENTS, 1)]
LOADS = [encode_active_load(ActiveLoad(3, 0, 4, 128, 95)), encode_active_load(ActiveLoad(2**64 - 1, 7, None, None, 0))]
SEQUENCE_EVENTS = [
    encode_sequence_event(ActiveSequenceEvent("req-1", 3, 0, AddRequest([1, 2, 2**64 - 1], True, 16, 4096), 9, "lora")),
    encode_sequence_event(ActiveSequenceEvent("req-1", 3, 1, AddRequest(None, False, None, None), 9)),
    encode_sequence_event(ActiveSequenceEvent("req-1", 3, 0, "MarkPrefillCompleted", 9)),
    encode_sequence_event(ActiveSequenceEvent("req-1", 3, 0, "Free", 9)),
]

FUZZ = settings(max_examples=300, deadline=None)


def _junk(seeds: list[bytes]) -> st.SearchStrategy[bytes]:
    deep = st.tuples(DEPTHS, st.sampled_from(["array", "map"])).map(lambda t: Blob(deep_msgpack(*t)))
    return hostile(seeds, msgspec.msgpack.decode, msgspec.msgpack.encode, MSGPACK_JUNK) | deep


def _named(exc: DecodeError) -> None:
    """A decode error says what and where: a known kind, the field, and a message an operator can read."""
    assert isinstance(exc.kind, ErrorKind) and exc.field and str(exc)


def _check_event(ev: RouterEvent) -> None:
    assert 0 <= ev.worker_id < U64 and 0 <= ev.dp_rank < 2**32 and 0 <= ev.event_id < U64
    if isinstance(ev.data, Stored):
        assert len(ev.data.block_hashes) == len(ev.data.tokens_hashes)
        assert all(0 <= h < U64 for h in ev.data.block_hashes + ev.data.tokens_hashes)


def decode_core(data: bytes) -> RouterEvent:
    """What `EventPlane._on_core_event` decodes of one NATS Core message."""
    return decode_router_event_msgpack(decode_envelope(data).payload)


# ----- the decoders ---------------------------------------------------------------------------------------


@FUZZ
@given(_junk(ROUTER_EVENTS))
@example(Blob(deep_msgpack(100_000, "map")))
def test_router_event_msgpack_raises_only_decode_error(data: bytes) -> None:
    try:
        ev = decode_router_event_msgpack(data)
    except DecodeError as exc:
        _named(exc)
        return
    _check_event(ev)


_ENVELOPE_PAYLOADS = st.tuples(st.sampled_from(ENVELOPES), _junk(ROUTER_EVENTS)).map(
    lambda t: Blob(encode_envelope(EventEnvelope(7, 1, 0, "kv-events", bytes(t[1])))))


@FUZZ
@given(_junk(ENVELOPES) | _ENVELOPE_PAYLOADS)
def test_core_event_envelope_and_payload_raise_only_decode_error(data: bytes) -> None:
    try:
        ev = decode_core(data)
    except DecodeError as exc:
        _named(exc)
        return
    _check_event(ev)


@FUZZ
@given(_junk(LOADS))
def test_active_load_raises_only_decode_error(data: bytes) -> None:
    try:
        load = decode_active_load(data)
    except DecodeError as exc:
        _named(exc)
        return
    assert 0 <= load.worker_id < U64 and 0 <= load.dp_rank < 2**32
    for value in (load.active_decode_blocks, load.active_prefill_tokens, load.kv_used_blocks):
        assert value is None or (type(value) is int and 0 <= value < U64)


@FUZZ
@given(_junk(SEQUENCE_EVENTS))
def test_sequence_event_raises_only_decode_error(data: bytes) -> None:
    try:
        ev = decode_sequence_event(data)
    except DecodeError as exc:
        _named(exc)
        return
    assert isinstance(ev.request_id, str) and 0 <= ev.worker_id < U64 and 0 <= ev.router_id < U64
    assert ev.lora_name is None or isinstance(ev.lora_name, str)
    if isinstance(ev.action, AddRequest):
        tokens = ev.action.token_sequence
        assert tokens is None or all(type(t) is int and 0 <= t < U64 for t in tokens)
        assert isinstance(ev.action.track_prefill_tokens, bool)
    else:
        assert ev.action in ("Free", "MarkPrefillCompleted")


# ----- a real nats-server ---------------------------------------------------------------------------------

_namespaces = itertools.count()
GOOD_WORKER = 2**64 - 3  # no seed has it, and junk draws it with probability 2^-64
ROUTER_ID = 5


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    srv = NatsServer(tmp_path_factory.mktemp("nats"))
    yield srv
    srv.stop()


@dataclass
class Plane:
    """A router's event plane (Core mode, replica sync on) and a publisher, shared by every example."""

    fleet: Fleet
    streams: Streams
    plane: EventPlane
    nc: nats.NATS
    names: PlaneNames
    next_id: int = 1

    async def until(self, condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.plane.state == "connected", self.plane.status()
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {self.plane.status()}"
            await asyncio.sleep(0.005)

    def good_event(self) -> RouterEvent:
        tokens = list(range(16 * self.next_id, 16 * self.next_id + 16))
        local = local_block_hashes(tokens, 16)
        ev = RouterEvent(GOOD_WORKER, Stored(None, sequence_hashes(local), local), 0, self.next_id)
        self.next_id += 1
        return ev


@pytest.fixture(params=["core"])
async def rig(server: NatsServer, request: pytest.FixtureRequest) -> AsyncIterator[Plane]:
    names = PlaneNames(f"fuzz{next(_namespaces)}", "backend")
    fleet = Fleet(block_size=16, seed=0)
    streams = Streams(fleet)
    plane = EventPlane(fleet, streams, NatsOptions(NatsConnection(server.url), names.namespace, names.component,
                                                   router_id=ROUTER_ID, replica_sync=True,
                                                   jetstream=request.param == "jetstream"))
    plane.start()
    nc: nats.NATS | None = None
    try:
        assert await plane.ready(10), plane.status()
        nc = await nats.connect(server.url)
        yield Plane(fleet, streams, plane, nc, names)
        assert plane.state == "connected" and plane.last_error is None, plane.status()
    finally:
        if nc is not None:
            await nc.drain()
        await plane.close()
        await streams.close()


def _expected_errors(decode: Callable[[bytes], Any], payloads: list[bytes]) -> tuple[Counter[str], int]:
    """Decode errors by kind, and how many payloads decoded."""
    errors: Counter[str] = Counter()
    for payload in payloads:
        try:
            decode(payload)
        except DecodeError as exc:
            errors[exc.kind.value] += 1
    return errors, len(payloads) - sum(errors.values())


_SUBJECT_JUNK = st.lists(_junk(ENVELOPES) | _ENVELOPE_PAYLOADS, max_size=5)
_LOAD_JUNK = st.lists(_junk(LOADS), max_size=3)
_SEQUENCE_JUNK = st.lists(_junk(SEQUENCE_EVENTS), max_size=3)
_BIG = Blob(b"\xc6" + (900_000).to_bytes(4, "big") + b"\x00" * 900_000)  # under NATS's 1 MB max_payload


# The plane is shared by every example on purpose (each checks the change in its counters).
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_SUBJECT_JUNK, _LOAD_JUNK, _SEQUENCE_JUNK)
@example([_BIG, Blob(deep_msgpack(10_000))], [_BIG], [Blob(deep_msgpack(10_000, "map"))])
async def test_junk_on_every_subject_is_counted_and_good_events_still_apply(
        rig: Plane, kv: list[bytes], loads: list[bytes], sequences: list[bytes]) -> None:
    plane = rig.plane
    errors_before, counts_before = Counter(plane.errors), Counter(plane.counts)
    kv_errors, _ = _expected_errors(decode_core, kv)
    load_errors, loads_ok = _expected_errors(decode_active_load, loads)
    sequence_errors, sequences_ok = _expected_errors(decode_sequence_event, sequences)
    own = sum(1 for s in sequences if _router_id(s) == ROUTER_ID)  # this router's own echoes are ignored

    for payload in kv:
        await rig.nc.publish(rig.names.kv_events, payload)
    for payload in loads:
        await rig.nc.publish(rig.names.kv_metrics, payload)
    for payload in sequences:
        await rig.nc.publish(rig.names.active_sequences, payload)
    good = rig.good_event()
    await rig.nc.publish(rig.names.kv_events, encode_envelope(EventEnvelope(
        99, good.event_id, 0, "kv-events", encode_router_event_msgpack(good))))
    await barrier(rig.nc)

    def counted() -> Counter[str]:
        return plane.counts - counts_before

    expected_errors = kv_errors + load_errors + sequence_errors
    await rig.until(lambda: counted()["messages"] == len(kv) + 1
                    and counted()["load_reports"] == loads_ok
                    and counted()["own_sequence_events"] + counted()["peer_sequence_events"] == sequences_ok
                    and plane.errors - errors_before == expected_errors, "every message")
    assert counted()["own_sequence_events"] == own
    assert plane.errors - errors_before == expected_errors
    # The good event after the junk is applied: the plane still follows its worker's ids and fills the index.
    await rig.streams.writer("default").applied()
    cursor = plane.cursors[(GOOD_WORKER, 0)]
    assert cursor.last == good.event_id
    held = rig.fleet.models["default"].router.index.dump()
    assert any(ev.worker_id == GOOD_WORKER and isinstance(ev.data, Stored)
               and good.data.block_hashes[0] in ev.data.block_hashes for ev in held)  # type: ignore[union-attr]
    assert plane.state == "connected" and plane.last_error is None, plane.status()


_DUMP_LINES = [Blob(line.encode()) for line in (FIXTURES / "dynamo-1.6.1" / "dump.jsonl").read_text().splitlines()]
_JSON_JUNK = (hostile(_DUMP_LINES, json.loads, lambda v: json.dumps(v).encode(), JSON_JUNK)
              | st.tuples(DEPTHS, st.sampled_from(["array", "map"])).map(lambda t: Blob(deep_json(*t))))


@pytest.mark.parametrize("rig", ["jetstream"], indirect=True)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_JSON_JUNK, min_size=1, max_size=6))
@example([Blob(b'{"worker_id": NaN}'), Blob(b"[" * 100_000), Blob(b'{"worker_id": 18446744073709551616}')])
async def test_junk_on_the_jetstream_subject_is_counted_and_good_events_still_apply(
        rig: Plane, lines: list[bytes]) -> None:
    """JetStream mode: workers publish RouterEvent JSON to the stream; junk there is counted and skipped (and
    acknowledged with the rest, so it is not redelivered forever)."""
    js = rig.nc.jetstream()
    plane = rig.plane
    errors_before, counts_before = Counter(plane.errors), Counter(plane.counts)
    expected_errors, _ = _expected_errors(decode_router_event_json, lines)
    for line in lines:
        await js.publish(rig.names.stream_subject, line)
    good = rig.good_event()
    await js.publish(rig.names.stream_subject, encode_router_event_json(good))
    await rig.until(lambda: (plane.counts - counts_before)["messages"] == len(lines) + 1
                    and plane.errors - errors_before == expected_errors, "every message")
    await rig.streams.writer("default").applied()
    assert plane.cursors[(GOOD_WORKER, 0)].last == good.event_id
    held = rig.fleet.models["default"].router.index.dump()
    assert any(ev.worker_id == GOOD_WORKER and isinstance(ev.data, Stored)
               and good.data.block_hashes[0] in ev.data.block_hashes for ev in held)  # type: ignore[union-attr]


def _router_id(payload: bytes) -> int | None:
    try:
        return decode_sequence_event(payload).router_id
    except DecodeError:
        return None
