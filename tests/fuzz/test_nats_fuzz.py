"""Hostile payloads on the NATS event plane: the decoders `kvctl serve --nats` runs on each topic, then a real
nats-server carrying junk on every subject of the namespace it follows.

Dynamo 1.6.1 wraps every topic's payload in the same envelope (docs/contract.md). The envelope alone and RouterEvent
JSON are fuzzed in tests/core/test_events_fuzz.py; here: each topic's payload (a `kv-events` array of
RouterEvents, load reports, replica-sync events, forward passes), and envelope and payload decoded together as
`EventPlane._on_message` does. Only `DecodeError` may come out, and it must name the field. Seeds: the bytes a
running fleet put on the wire (tests/fixtures/dynamo-1.6.1-fleet), and a few at the edges of each field's range.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats
import pytest
from hypothesis import HealthCheck, example, given, note, settings
from hypothesis import strategies as st

from kvctl.core.events import Cleared, DecodeError, ErrorKind, Removed, RouterEvent, Stored
from kvctl.core.events.dynamo import (
    EnvelopeWriter,
    EventEnvelope,
    decode_envelope,
    decode_router_event_batch,
    decode_router_event_json,
    decode_router_event_msgpack,
    encode_envelope,
    encode_router_event_batch,
    encode_router_event_json,
    encode_router_event_msgpack,
)
from kvctl.core.events.plane import (
    ACTIVE_SEQUENCES,
    FORWARD_PASS,
    KV_EVENTS,
    KV_METRICS,
    TOPICS,
    ActiveLoad,
    ActiveSequenceEvent,
    AddRequest,
    ForwardPass,
    PlaneNames,
    RequestCounts,
    decode_active_load,
    decode_forward_pass,
    decode_sequence_event,
    encode_active_load,
    encode_forward_pass,
    encode_sequence_event,
)
from kvctl.core.events.publishers import Numbering, Order, PublisherBook
from kvctl.core.hashing import local_block_hashes, sequence_hashes
from kvctl.nats.barrier import barrier
from kvctl.nats.connection import NatsConnection
from kvctl.server.ingest.streams import Streams
from kvctl.server.plane.nats_plane import EventPlane, NatsOptions
from kvctl.server.state import Fleet
from tests.fixtures_path import FIXTURES
from tests.fuzz.junk import (
    DEPTHS,
    JSON_JUNK,
    MSGPACK_JUNK,
    U64,
    WRONG_TYPED,
    Blob,
    deep_json,
    deep_msgpack,
    hostile,
    paths,
    replaced,
)
from tests.nats_server import NatsServer
from tests.support import eventually_async

ROUTER_ID = 5  # the rig's router: replica-sync events with this router id are its own echoes

CAPTURE = [json.loads(line) for line in
           (FIXTURES / "dynamo-1.6.1-fleet" / "nats_capture.jsonl").read_text().splitlines()]
ENVELOPES = {topic: sorted({bytes.fromhex(m["hex"]) for m in CAPTURE if m["subject"].rsplit(".", 1)[1] == topic})
             for topic in TOPICS}
"""Each topic's envelopes exactly as the fleet sent them."""

DUMP = [decode_router_event_json(line) for line in (FIXTURES / "dynamo-1.6.1" / "dump.jsonl").read_text().splitlines()]
_COUNTS = RequestCounts(2, 4096, 1.5, 16, 3, 2**64 - 1, 0.25)
PAYLOADS = {
    topic: [decode_envelope(e).payload for e in envelopes] for topic, envelopes in ENVELOPES.items()
}
_OTHER_EVENTS = [RouterEvent(2**64 - 1, Removed([1, 2**64 - 1]), 2**32 - 1, 2**64 - 1), RouterEvent(3, Cleared(), 0, 9)]
PAYLOADS[KV_EVENTS] += [*(encode_router_event_batch([ev]) for ev in DUMP), encode_router_event_batch(DUMP[:3]),
                        encode_router_event_batch(_OTHER_EVENTS),
                        encode_router_event_msgpack(DUMP[0])]  # a bare map: a batch of one
PAYLOADS[KV_METRICS] += [encode_active_load(ActiveLoad(3, 0, 4, 128, 95)),
                         encode_active_load(ActiveLoad(2**64 - 1, 7, None, None, 0))]
PAYLOADS[ACTIVE_SEQUENCES] += [
    encode_sequence_event(ActiveSequenceEvent("req-1", 3, 0, AddRequest([1, 2, 2**64 - 1], True, 16, 4096), 9, "lora")),
    encode_sequence_event(ActiveSequenceEvent("req-1", 3, 1, AddRequest(None, False, None, None), 9)),
    encode_sequence_event(ActiveSequenceEvent("req-1", 3, 0, "Free", ROUTER_ID)),
]
PAYLOADS[FORWARD_PASS] += [encode_forward_pass(ForwardPass(2**64 - 1, 2**32 - 1, 2**64 - 1, 1e9, _COUNTS,
                                                           RequestCounts(), 2**32 - 1))]

FUZZ = settings(max_examples=300, deadline=None)


def _junk(seeds: list[bytes]) -> st.SearchStrategy[bytes]:
    deep = st.tuples(DEPTHS, st.sampled_from(["array", "map"])).map(lambda t: Blob(deep_msgpack(*t)))
    return hostile(seeds, msgspec.msgpack.decode, msgspec.msgpack.encode, MSGPACK_JUNK) | deep


PUBLISHERS = st.sampled_from([1, 2, 3])
SEQUENCES = st.integers(0, 3)
"""Few publishers and sequences, so that the server test's shared plane sees repeats, restarts and gaps."""


def _wrapped(topic: str) -> st.SearchStrategy[bytes]:
    """What a hostile or broken publisher can put on a topic's subject: junk near the fleet's envelopes, and
    valid envelopes around junk near real payloads (or around a real payload)."""
    real, junk = st.sampled_from(PAYLOADS[topic]), _junk(PAYLOADS[topic])
    payload = st.booleans().flatmap(lambda is_real: real if is_real else junk)  # half and half
    around = st.tuples(PUBLISHERS, SEQUENCES, payload).map(
        lambda t: Blob(encode_envelope(EventEnvelope(t[0], t[1], 1_795_312_301_289, topic, bytes(t[2])))))
    return _junk(ENVELOPES[topic]) | around


WRAPPED = {topic: _wrapped(topic) for topic in TOPICS}


def _named(exc: DecodeError) -> None:
    """A decode error says what and where: a known kind, the field, and a message an operator can read."""
    assert isinstance(exc.kind, ErrorKind) and exc.field and str(exc)


def _check_event(ev: RouterEvent) -> None:
    assert 0 <= ev.worker_id < U64 and 0 <= ev.dp_rank < 2**32 and 0 <= ev.event_id < U64
    if isinstance(ev.data, Stored):
        assert len(ev.data.block_hashes) == len(ev.data.tokens_hashes)
        assert all(0 <= h < U64 for h in ev.data.block_hashes + ev.data.tokens_hashes)


def _check_batch(payload: bytes, decoded: tuple[list[RouterEvent], list[DecodeError]]) -> None:
    """Each item of the array is one event or one error, in order: a bad event costs itself, not its batch
    (a bare map is a batch of one)."""
    events, errors = decoded
    items = msgspec.msgpack.decode(payload)  # the decoder read it, so it reads
    items = [items] if isinstance(items, dict) else items
    assert isinstance(items, list) and len(events) + len(errors) == len(items)
    bad = [exc.index for exc in errors]
    assert bad == sorted(set(bad)) and all(n is not None and 0 <= n < len(items) for n in bad)
    for exc in errors:
        _named(exc)
    assert events == [decode_router_event_msgpack(msgspec.msgpack.encode(item))
                      for n, item in enumerate(items) if n not in bad]
    for ev in events:
        _check_event(ev)


def _check_load(load: ActiveLoad) -> None:
    assert 0 <= load.worker_id < U64 and 0 <= load.dp_rank < 2**32
    for value in (load.active_decode_blocks, load.active_prefill_tokens, load.kv_used_blocks):
        assert value is None or (type(value) is int and 0 <= value < U64)


def _check_sequence_event(ev: ActiveSequenceEvent) -> None:
    assert isinstance(ev.request_id, str) and 0 <= ev.worker_id < U64 and 0 <= ev.router_id < U64
    assert 0 <= ev.dp_rank < 2**32 and (ev.lora_name is None or isinstance(ev.lora_name, str))
    if isinstance(ev.action, AddRequest):
        tokens = ev.action.token_sequence
        assert tokens is None or all(type(t) is int and 0 <= t < U64 for t in tokens)
        assert isinstance(ev.action.track_prefill_tokens, bool)
        for value in (ev.action.expected_output_tokens, ev.action.prefill_tokens_hint):
            assert value is None or (type(value) is int and 0 <= value < U64)
    else:
        assert ev.action in ("Free", "MarkPrefillCompleted")


def _check_forward_pass(report: ForwardPass) -> None:
    assert 0 <= report.worker_id < U64 and 0 <= report.dp_rank < 2**32 and 0 <= report.counter_id < U64
    assert 0 <= report.version < 2**32 and type(report.wall_time) is float and math.isfinite(report.wall_time)
    for counts in (report.scheduled, report.queued):
        ints = [counts.prefill_requests, counts.prefill_tokens, counts.decode_requests, counts.decode_kv_tokens]
        if counts.prefill_kv_tokens is not None:
            ints.append(counts.prefill_kv_tokens)
        assert all(type(value) is int and 0 <= value < U64 for value in ints)
        variances = (counts.prefill_length_var, counts.decode_kv_tokens_var)
        assert all(type(value) is float and math.isfinite(value) for value in variances)


DECODERS: dict[str, Callable[[bytes], Any]] = {
    KV_EVENTS: decode_router_event_batch, KV_METRICS: decode_active_load,
    ACTIVE_SEQUENCES: decode_sequence_event, FORWARD_PASS: decode_forward_pass,
}
CHECKS: dict[str, Callable[[bytes, Any], None]] = {  # (payload, what it decoded to)
    KV_EVENTS: _check_batch, KV_METRICS: lambda _, load: _check_load(load),
    ACTIVE_SEQUENCES: lambda _, ev: _check_sequence_event(ev),
    FORWARD_PASS: lambda _, report: _check_forward_pass(report),
}


# ----- the decoders ---------------------------------------------------------------------------------------


@FUZZ
@given(_junk(PAYLOADS[KV_EVENTS]))
@example(Blob(deep_msgpack(100_000, "map")))
@example(Blob(msgspec.msgpack.encode([None, msgspec.msgpack.decode(PAYLOADS[KV_EVENTS][0])[0], 7, {}])))
def test_kv_events_batch_raises_only_decode_error_and_a_bad_event_costs_only_itself(data: bytes) -> None:
    try:
        decoded = decode_router_event_batch(data)
    except DecodeError as exc:
        _named(exc)
        assert not isinstance(_parsed(data), list), "an array is read item by item, never refused whole"
        return
    _check_batch(data, decoded)


def _parsed(data: bytes) -> Any:
    try:
        return msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None


@FUZZ
@given(_junk(PAYLOADS[KV_METRICS]))
def test_active_load_raises_only_decode_error(data: bytes) -> None:
    try:
        load = decode_active_load(data)
    except DecodeError as exc:
        _named(exc)
        return
    _check_load(load)


@FUZZ
@given(_junk(PAYLOADS[ACTIVE_SEQUENCES]))
def test_sequence_event_raises_only_decode_error(data: bytes) -> None:
    try:
        ev = decode_sequence_event(data)
    except DecodeError as exc:
        _named(exc)
        return
    _check_sequence_event(ev)


_HUGE_WORKER_ID = Blob(msgspec.msgpack.encode({"worker_id": "1" * 5000, "scheduled_requests": {},
                                               "queued_requests": {}}))


@FUZZ
@given(_junk(PAYLOADS[FORWARD_PASS]))
@example(Blob(msgspec.msgpack.encode({"worker_id": "0" * 40 + "7", "scheduled_requests": {}, "queued_requests": {}})))
@example(_HUGE_WORKER_ID)  # int() of over 4300 digits raises ValueError: the decoder must not try
def test_forward_pass_raises_only_decode_error(data: bytes) -> None:
    try:
        report = decode_forward_pass(data)
    except DecodeError as exc:
        _named(exc)
        return
    _check_forward_pass(report)


def _shapes(payloads: list[bytes]) -> list[bytes]:
    """One payload of each shape (the same locations): the captures repeat a few shapes many times."""
    shapes: dict[tuple[Any, ...], bytes] = {}
    for payload in payloads:
        shapes.setdefault(tuple(paths(msgspec.msgpack.decode(payload))), payload)
    return list(shapes.values())


_WRONG_MSGPACK = [v for v in WRONG_TYPED if not (type(v) is int and v >= U64)] + [2**32, b"\x00"]
"""msgpack holds no int from 2^64 on (2^32 is out of range for a u32 field), and has bytes."""


@pytest.mark.parametrize("topic", TOPICS)
def test_each_field_of_each_payload_shape_with_each_wrong_type_raises_only_decode_error(topic: str) -> None:
    """The sweep the fuzz tests sample from: every location of every seed's shape, replaced by a value of each
    kind (a NaN, a negative, 2^32, a string, bytes, a container, ...)."""
    for payload in _shapes(PAYLOADS[topic]):
        seed = msgspec.msgpack.decode(payload)
        for path, wrong in itertools.product(paths(seed), _WRONG_MSGPACK):
            data = msgspec.msgpack.encode(replaced(seed, path, wrong))
            try:
                try:
                    decoded = DECODERS[topic](data)
                except DecodeError as exc:
                    _named(exc)
                    continue
                CHECKS[topic](data, decoded)
            except Exception as exc:
                exc.add_note(f"{topic}: {path} = {wrong!r}")
                raise


_ON_A_TOPIC = st.one_of(*(st.tuples(st.just(topic), WRAPPED[topic]) for topic in TOPICS))


@FUZZ
@given(_ON_A_TOPIC)
def test_envelope_and_its_topics_payload_raise_only_decode_error(message: tuple[str, bytes]) -> None:
    """What the plane decodes of one message on a topic's subject: the envelope, then its payload."""
    topic, data = message
    try:
        envelope = decode_envelope(data)
        decoded = DECODERS[topic](envelope.payload)
    except DecodeError as exc:
        _named(exc)
        return
    assert 0 <= envelope.publisher_id < U64 and 0 <= envelope.sequence < U64 and 0 <= envelope.published_at < U64
    assert isinstance(envelope.topic, str) and isinstance(envelope.payload, bytes)
    CHECKS[topic](envelope.payload, decoded)


# ----- a real nats-server ---------------------------------------------------------------------------------

_namespaces = itertools.count()
GOOD_WORKER = 2**64 - 3  # no seed has it, and junk draws it with probability 2^-64
GOOD_PUBLISHER = 2**64 - 5  # likewise


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    srv = NatsServer(tmp_path_factory.mktemp("nats"))
    yield srv
    srv.stop()


@dataclass
class Plane:
    """A router's event plane (Core mode, replica sync on, component `backend`, every endpoint) and a publisher,
    shared by every example; `book` mirrors the plane's publishers across examples."""

    fleet: Fleet
    streams: Streams
    plane: EventPlane
    nc: nats.NATS
    names: PlaneNames
    next_id: int = 1
    book: PublisherBook = field(default_factory=PublisherBook)
    book_stale: bool = False  # an example failed: the model's book may have parted from the plane's
    good_writer: EnvelopeWriter = field(default_factory=lambda: EnvelopeWriter(GOOD_PUBLISHER, KV_EVENTS))

    async def until(self, condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
        def holds() -> bool:
            assert self.plane.state == "connected", self.plane.status()  # a lost connection fails at once
            return condition()

        await eventually_async(holds, what, timeout=timeout, interval=0.005)

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
    plane = EventPlane(fleet, streams, NatsOptions(connection=NatsConnection(server.url), namespace=names.namespace,
                                                   component=names.component, router_id=ROUTER_ID, replica_sync=True,
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


Message = tuple[str, str | None, bytes]
"""(subject, with `{ns}` for the rig's namespace; the topic the rig follows there, or None; body)"""

FOLLOWED = "namespace.{{ns}}.component.backend.endpoint.{endpoint}.{topic}"
NOT_FOLLOWED = [
    "namespace.{ns}.component.backend.kv-events",  # Dynamo's layout before 1.6
    "namespace.{ns}.kv_metrics",
    "namespace.{ns}.component.prefill.endpoint.generate.kv-events",  # a component the rig does not follow
    "namespace.{ns}.component.backend.endpoint.generate.kv-events.v2",  # one token too many
    "namespace.{ns}.components.backend.endpoint.generate.kv-events",
    "namespace.{ns}.component.backend.endpoint.generate.kv_hit_rate",  # a topic kvctl does not read
    "namespace.{ns}x.component.backend.endpoint.generate.kv-events",  # not even the namespace: never delivered
    "dynamo.kv-events",
]
MODELLED = ("messages", "events", "load_reports", "own_sequence_events", "peer_sequence_events", "forward_passes")

_MESSAGE = st.one_of(
    *(st.tuples(st.sampled_from(["generate", "clear"]).map(lambda ep, t=topic: FOLLOWED.format(endpoint=ep, topic=t)),
                st.just(topic), WRAPPED[topic]) for topic in TOPICS),
    st.tuples(st.sampled_from(NOT_FOLLOWED), st.none(), st.one_of(*WRAPPED.values())),
)
_BIG = Blob(b"\xc6" + (900_000).to_bytes(4, "big") + b"\x00" * 900_000)  # under NATS's 1 MB max_payload
_KV = FOLLOWED.format(endpoint="generate", topic=KV_EVENTS)
_LOADS = FOLLOWED.format(endpoint="generate", topic=KV_METRICS)
_SEQUENCES = FOLLOWED.format(endpoint="generate", topic=ACTIVE_SEQUENCES)


def _envelope(publisher_id: int, sequence: int, topic: str, payload: bytes) -> Blob:
    return Blob(encode_envelope(EventEnvelope(publisher_id, sequence, 0, topic, payload)))


def _expect(book: PublisherBook, namespace: str, messages: list[Message]) -> dict[str, Counter[str]]:
    """What the plane must count for these messages, by a reference model of docs/contract.md: a message on a subject
    of the namespace is seen; on a topic followed, its envelope decodes (or is one error), its publisher's
    sequence is judged on `book` (a repeat is dropped unread), and its payload decodes by its topic."""
    counts: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    topics: Counter[str] = Counter()
    seen: Counter[str] = Counter()
    for subject, topic, body in messages:
        if subject.startswith(f"namespace.{namespace}."):
            seen[subject] += 1
        if topic is None:
            continue
        topics[topic] += 1
        if topic == KV_EVENTS:
            counts["messages"] += 1  # read or not
        try:
            envelope = decode_envelope(body)
        except DecodeError as exc:
            errors[exc.kind.value] += 1
            continue
        order, _ = book.observe(envelope.publisher_id, envelope.sequence, time.monotonic(), topic, "", "")
        if order is Order.repeat:
            continue
        try:
            decoded = DECODERS[topic](envelope.payload)
        except DecodeError as exc:
            errors[exc.kind.value] += 1
            continue
        if topic == KV_EVENTS:
            events, bad = decoded
            counts["events"] += len(events)
            errors.update(exc.kind.value for exc in bad)
        elif topic == KV_METRICS:
            counts["load_reports"] += 1
        elif topic == FORWARD_PASS:
            counts["forward_passes"] += 1
        else:
            counts["own_sequence_events" if decoded.router_id == ROUTER_ID else "peer_sequence_events"] += 1
    return {"counts": +Counter({k: counts[k] for k in MODELLED}), "errors": errors, "topics": topics,
            "subjects_seen": seen}


def _publishers(book: PublisherBook) -> dict[int, tuple[int, ...]]:
    return {p.publisher_id: (p.sequence.last, p.sequence.messages, *p.sequence.counts().values())
            for p in book.publishers.values()}


def _snapshot(plane: EventPlane) -> dict[str, Counter[str]]:
    return {"counts": Counter({k: plane.counts[k] for k in MODELLED}), "errors": Counter(plane.errors),
            "topics": Counter(plane.ingest.topics), "subjects_seen": Counter(plane.subjects_seen)}


# The plane is shared by every example on purpose (each checks the change in its counters, and the publishers
# it has heard from stay, as they would on a live plane).
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_MESSAGE, min_size=1, max_size=12))
@example([(_KV, KV_EVENTS, _BIG), (_KV, KV_EVENTS, _envelope(1, 0, KV_EVENTS, _BIG[:-100])),
          (_LOADS, KV_METRICS, Blob(deep_msgpack(10_000))),
          (_SEQUENCES, ACTIVE_SEQUENCES, _envelope(2, 0, ACTIVE_SEQUENCES, deep_msgpack(10_000, "map")))])
@example([(_LOADS, KV_METRICS, _envelope(3, 1, KV_METRICS, PAYLOADS[KV_METRICS][0]))] * 2  # the second: a repeat
         + [(_SEQUENCES, ACTIVE_SEQUENCES, _envelope(3, 0, ACTIVE_SEQUENCES, PAYLOADS[ACTIVE_SEQUENCES][-1]))])
async def test_junk_on_every_subject_is_counted_and_good_events_still_apply(
        rig: Plane, messages: list[Message]) -> None:
    plane, ns = rig.plane, rig.names.namespace
    good = rig.good_event()  # an array of one RouterEvent, from a publisher with a fresh sequence
    good_body = Blob(rig.good_writer.wrap(encode_router_event_batch([good]), int(time.time() * 1000)))
    messages = [(subject.format(ns=ns), topic, body)
                for subject, topic, body in [*messages, (_KV, KV_EVENTS, good_body)]]
    note(f"messages: {messages!r}")  # Hypothesis cannot show the arguments of an async test
    if rig.book_stale:  # judge this example from where the plane is (shrinking replays examples after a failure)
        rig.book = copy.deepcopy(plane.ingest.publishers)
    rig.book_stale = True
    before = _snapshot(plane)
    expected = _expect(rig.book, ns, messages)

    for subject, _, body in messages:
        await rig.nc.publish(subject, body)
    await barrier(rig.nc)
    # One subscription handles its messages in order: once the good event (the last one) is in, all are.
    await rig.until(lambda: getattr(plane.cursors.get((GOOD_WORKER, 0)), "ids", Numbering()).last == good.event_id,
                    "the good event")
    counted = {name: after - before[name] for name, after in _snapshot(plane).items()}
    assert counted == expected
    assert _publishers(plane.ingest.publishers) == _publishers(rig.book)
    # The good event after the junk is applied: the plane still follows its worker's ids and fills the index.
    await rig.streams.writer("default").applied()
    held = rig.fleet.models["default"].router.index.dump()
    assert any(ev.worker_id == GOOD_WORKER and isinstance(ev.data, Stored)
               and good.data.block_hashes[0] in ev.data.block_hashes for ev in held)  # type: ignore[union-attr]
    assert plane.state == "connected" and plane.last_error is None, plane.status()
    rig.book_stale = False


_DUMP_LINES = [Blob(line.encode()) for line in (FIXTURES / "dynamo-1.6.1" / "dump.jsonl").read_text().splitlines()]
_JSON_JUNK = (hostile(_DUMP_LINES, json.loads, lambda v: json.dumps(v).encode(), JSON_JUNK)
              | st.tuples(DEPTHS, st.sampled_from(["array", "map"])).map(lambda t: Blob(deep_json(*t))))


@pytest.mark.parametrize("rig", ["jetstream"], indirect=True)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_JSON_JUNK, min_size=1, max_size=6))
@example([Blob(b'{"worker_id": NaN}'), Blob(b"[" * 100_000), Blob(b'{"worker_id": 18446744073709551616}')])
async def test_junk_on_the_jetstream_subject_is_counted_and_good_events_still_apply(
        rig: Plane, lines: list[bytes]) -> None:
    """JetStream mode (kvctl's own durable plane): RouterEvent JSON on the stream; junk there is counted and
    skipped (and acknowledged with the rest, so it is not redelivered forever)."""
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
    assert plane.cursors[(GOOD_WORKER, 0)].ids.last == good.event_id
    held = rig.fleet.models["default"].router.index.dump()
    assert any(ev.worker_id == GOOD_WORKER and isinstance(ev.data, Stored)
               and good.data.block_hashes[0] in ev.data.block_hashes for ev in held)  # type: ignore[union-attr]
