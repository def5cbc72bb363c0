"""Hostile engine traffic on a real ZMQ socket pair: an `EngineStream` subscribed to a PUB on loopback.

Messages with the wrong number of frames, seq frames of the wrong length, non-UTF-8 topics, payloads of
a few MB, msgpack nested 100k deep and real vLLM/SGLang batches with a wrong-typed value in any field.
Whatever arrives, the stream must keep running, count every bad message (or bad event) by the kind the
codec gives it, consume the seq of every message that has one (no false gap, no restart), and apply the
valid batch sent after the junk.

One socket pair serves every example of a test (starting sockets per example is slow): each example
checks the stream's cumulative counters against the cumulative oracle.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvctl.core.events import DecodeError, ErrorKind, EventData, decode_engine_batch, decode_engine_message
from kvctl.core.events.normalizer import StreamNormalizer
from kvctl.server.ingest.decode_process.parent import Decoder, InlineDecoder, ProcessDecoder
from kvctl.server.ingest.zmq_source import EngineStream
from tests.fixtures_path import FIXTURES
from tests.fuzz.junk import (
    DEPTHS,
    MSGPACK_JUNK,
    WRONG_TYPED,
    Blob,
    deep_msgpack,
    huge_msgpack_payloads,
    mutated,
    paths,
    replaced,
)
from tests.plain_events import plain
from tests.server.zmq_engine import Engine
from tests.support import eventually_async

BLOCK_SIZE = 16
STREAM_DP_RANK = 0
FOLDERS = ["vllm-0.33", "sglang-0.5.23", "vllm-legacy/0.23.0", "vllm-legacy/0.10.2"]
CAPTURES = [Blob(p.read_bytes()) for folder in FOLDERS for p in sorted((FIXTURES / folder).glob("*.msgpack"))]
# Captures that decode whole and carry events: what is sent after the junk, to see the stream carry on.
VALID = [p for p in CAPTURES if (b := decode_engine_batch(p, default_block_size=BLOCK_SIZE)).events and not b.errors]
MSGPACK_WRONG = [v for v in WRONG_TYPED if not (type(v) is int and v >= 2**64)] + [-(2**63), b"", b"\x01" * 9]

# One message: ("raw", frames) is sent as is; ("seq", topic, payload) gets the stream's next seq.
Message = tuple[Any, ...]

_frame = st.binary(max_size=48)
WRONG_FRAME_COUNT = st.sampled_from([1, 2, 4, 5]).flatmap(
    lambda n: st.lists(_frame, min_size=n, max_size=n)).map(lambda frames: ("raw", frames))
_seq_of_wrong_length = st.sampled_from([0, 1, 4, 7, 9, 16]).flatmap(lambda n: st.binary(min_size=n, max_size=n))
BAD_SEQ_LENGTH = st.tuples(_frame, _seq_of_wrong_length, _frame | st.sampled_from(CAPTURES)).map(
    lambda t: ("raw", list(t)))
TOPICS = st.sampled_from([b"", b"kv-events", b"\xff\xfe"]) | st.text(max_size=8).map(str.encode) | _frame
_wrong_typed_batch = st.sampled_from(CAPTURES).flatmap(lambda c: mutated(msgspec.msgpack.decode(c), MSGPACK_JUNK)).map(
    msgspec.msgpack.encode)  # wrong types anywhere in a real batch
PAYLOADS = (  # Hypothesis leans to the first branches: the likeliest input first
    _wrong_typed_batch
    | st.binary(max_size=256)
    | st.sampled_from(CAPTURES).flatmap(lambda c: st.integers(0, len(c) - 1).map(lambda n: c[:n]))  # truncated
    | st.tuples(DEPTHS, st.sampled_from(["array", "map"])).map(lambda t: deep_msgpack(*t))
    | DEPTHS.map(lambda d: b"\x93\xcb" + b"\x00" * 8 + deep_msgpack(d) + b"\x00")  # [ts, <deep>, 0]
    | huge_msgpack_payloads()
    | MSGPACK_JUNK.map(msgspec.msgpack.encode)
).map(Blob)
WITH_SEQ = st.tuples(st.just("seq"), TOPICS, PAYLOADS)
MESSAGES = st.lists(WITH_SEQ | WRONG_FRAME_COUNT | BAD_SEQ_LENGTH, min_size=1, max_size=6)  # the likeliest first


def oracle(frames: list[bytes], normalizer: StreamNormalizer) -> tuple[Counter[str], list[EventData]]:
    """What the codec says of one live message: errors by kind, and the events the stream delivers of it once
    `normalizer` (the stream's twin, fed the same batches) has dropped those Dynamo would not index."""
    try:
        message = decode_engine_message(frames, default_block_size=BLOCK_SIZE)
    except DecodeError as exc:
        return Counter({exc.kind.value: 1}), []
    batch = message.batch
    dp_rank = STREAM_DP_RANK if batch.dp_rank is None else batch.dp_rank
    events, _ = normalizer.admit(dp_rank, batch.events, batch.filtered)
    return Counter(error.kind.value for error in batch.errors), events


@dataclass
class Rig:
    """An engine PUB and a subscribed stream, with what the codec says the stream should count.

    The expectations start from the stream's counters at `begin()`, so one failing example does not
    fail every later one (and Hypothesis can shrink it).
    """

    engine: Engine
    stream: EngineStream
    task: asyncio.Task[None]
    delivered: list[tuple[tuple[int, int], list[EventData]]]
    next_seq: int = 0
    messages: int = 0
    batches: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    events: int = 0
    sink_calls: int = 0
    normalizer: StreamNormalizer = field(default_factory=StreamNormalizer)
    last_events: list[EventData] = field(default_factory=list)

    def begin(self) -> None:
        stats = self.stream.stats
        assert not self.task.done(), "the stream died"
        assert stats.last_seq is None or stats.last_seq == self.next_seq - 1
        self.messages, self.batches, self.events = stats.messages, stats.batches_applied, stats.events
        self.errors = Counter(stats.decode_errors)
        self.sink_calls = len(self.delivered)

    async def send(self, message: Message) -> None:
        if message[0] == "raw":
            frames = message[1]
        else:
            frames = [message[1], self.next_seq.to_bytes(8, "big"), message[2]]
            self.next_seq += 1
            self.batches += 1
        errors, events = oracle(frames, self.normalizer)
        self.errors += errors
        self.events += len(events)
        self.sink_calls += bool(events)  # one sink call per batch with events
        self.last_events = events
        self.messages += 1
        await self.engine.send_raw(frames)

    async def settled(self, timeout: float = 20.0) -> None:
        """Every message sent has been received, and every batch with a seq decoded and delivered."""
        def stats() -> Any:
            assert not self.task.done(), "the stream died"  # fails at once, not at the timeout
            return self.stream.stats

        await eventually_async(stats, f"{self.messages} messages and {self.batches} batches taken",
                               until=lambda s: s.messages >= self.messages and s.batches_applied >= self.batches,
                               timeout=timeout, interval=0.002)

    def check(self) -> None:
        stats = self.stream.stats
        assert not self.task.done(), "the stream died"
        assert (stats.messages, stats.batches_applied) == (self.messages, self.batches)
        assert stats.decode_errors == {k: v for k, v in self.errors.items() if v}
        assert stats.events == self.events and len(self.delivered) == self.sink_calls
        assert self.stream.drops.normalizer.dropped == self.normalizer.dropped
        assert (stats.gaps, stats.lost_batches, stats.restarts, stats.duplicates) == (0, 0, 0, 0)
        assert stats.last_seq == self.next_seq - 1

    async def valid_batch_applies(self, payload: bytes) -> None:
        """The stream carries on: a real batch sent after the junk reaches the sink, whole."""
        await self.send(("seq", b"", payload))
        await self.settled()
        self.check()
        assert self.last_events, "a valid batch of a capture must deliver events"
        assert list(map(plain, self.delivered[-1][1])) == list(map(plain, self.last_events))


@pytest.fixture(params=["inline", "process"])
async def rig(request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    """One engine PUB + one stream for the whole test; the stream is checked not to have died at the end."""
    ctx = zmq.asyncio.Context()
    decoder: Decoder = InlineDecoder() if request.param == "inline" else ProcessDecoder()
    engine = Engine(ctx)
    delivered: list[tuple[tuple[int, int], list[EventData]]] = []
    stream = EngineStream((7, STREAM_DP_RANK), engine.endpoint, None, block_size=BLOCK_SIZE,
                          sink=lambda key, events, mark: delivered.append((key, events)),
                          on_restart=lambda key: pytest.fail(f"a restart of {key} was detected in junk"),
                          context=ctx, decoder=decoder, rcvhwm=0)
    rig = Rig(engine, stream, asyncio.ensure_future(stream.run()), delivered)
    try:
        await engine.subscribed()
        rig.begin()
        await rig.valid_batch_applies(VALID[0])
        yield rig
        assert not rig.task.done(), "the stream died"
    finally:
        await stream.aclose()
        await decoder.close()
        await engine.close()
        ctx.destroy(linger=0)
    rig.task.result()  # ended by aclose(), not by an exception


_DEEP = Blob(deep_msgpack(10_000))


# The rig is shared by every example on purpose (each checks cumulative counters against the oracle).
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(MESSAGES, st.sampled_from(VALID))
@example([("raw", [b"only one frame"]), ("raw", [b"", b"\x00" * 8]), ("raw", [b"", b"\x00" * 8, b"", b"", b""]),
          ("raw", [b"", b"\x00" * 7, VALID[0]]), ("raw", [b"", b"\x00" * 9, VALID[0]])], VALID[1])
@example([("seq", b"", _DEEP), ("seq", b"", Blob(b"\x93\xcb" + b"\x00" * 8 + _DEEP + b"\x00")),
          ("seq", b"\xff", VALID[0])], VALID[0])
@example([("seq", b"", Blob(b"\xc6" + (3 << 20).to_bytes(4, "big") + b"\x00" * (3 << 20)))], VALID[0])
async def test_junk_is_counted_by_kind_and_the_stream_carries_on(rig: Rig, messages: list[Message],
                                                                  valid: bytes) -> None:
    rig.begin()
    for message in messages:
        await rig.send(message)
    await rig.valid_batch_applies(valid)


def _every_field_wrong_typed() -> list[bytes]:
    """Each real capture with, in turn, every field (and the first items of every array) set to a value of
    every type: the exhaustive part of "wrong types in every field"."""
    out = []
    for capture in CAPTURES:
        seed = msgspec.msgpack.decode(capture)
        for path in paths(seed, elements=1):
            for value in MSGPACK_WRONG:
                out.append(msgspec.msgpack.encode(replaced(seed, path, value)))
    return out


@pytest.mark.parametrize("rig", ["inline"], indirect=True)  # the codec is the same in the decode process
async def test_every_field_of_every_capture_wrong_typed(rig: Rig) -> None:
    payloads = _every_field_wrong_typed()
    rig.begin()
    assert len(payloads) > 5_000  # every capture, every field, every type: a shrinking sweep must not pass quietly
    for n, payload in enumerate(payloads):
        await rig.send(("seq", b"", payload))
        if n % 500 == 499:  # the PUB's queue is ample, but let the stream keep up
            await rig.settled()
    await rig.settled()
    rig.check()
    assert sum(rig.errors.values()) > len(payloads) // 2  # most replacements are errors the codec names
    # ... and every field was reached: each kind of error an event's field can have was counted
    assert {kind.value for kind in ErrorKind} - {"bad_msgpack", "bad_json"} <= set(rig.stream.stats.decode_errors)
    await rig.valid_batch_applies(VALID[-1])

