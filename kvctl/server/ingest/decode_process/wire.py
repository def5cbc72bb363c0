"""The pipe protocol between the router and its decode process (`kvctl.server.ingest.decode_process.parent`).

Decoding an engine batch (msgpack, then one XXH3 per block of token ids) costs about twice what
applying it to the index does, and receiving it from ZMQ about half, so a router with a spare core
has a child process receive and decode. What crosses the pipe must be much cheaper to read than
the payload it replaces: answers are the decoded events as flat msgpack arrays of ints (no maps,
no names), many of them per read.

Requests (router -> child): u32 LE payload length, u32 LE block size, payload.
  - block size > 0: decode this payload (a replayed batch) and answer it;
  - block size 0 (`CONTROL`): the payload is a msgpack command, answered by nothing:
    `["open", key, endpoint, topic, rcvhwm, block size, max message bytes]` subscribes to an engine's PUB and
    sends every live message received there; `["close", key]` unsubscribes.
Answers (child -> router): u32 LE body length, u8 origin, body.
  - origin 0 (`REQUEST`): the answer to the oldest unanswered decode request: msgpack
    `[ts, dp_rank, events, error kinds]` for a batch, or `[kind]` when the whole payload failed;
    events are `[0, parent, hashes, locals, tier]` (stored), `[1, hashes, tier]` (removed) or `[2]`
    (cleared); a store that names a group, a salt, a cut or its token ids adds `[group, salt, cut, cut_blocks,
    rehash]`, a removal that
    names a group adds `[group]` (`Group` as its array), and a batch with filtered events adds their causes.
    Requests are answered one each, in request order.
  - origin 1 (`LIVE`): a message received on stream `key`: msgpack `[key, seq, seen, answer]`,
    `seq` nil when the frames carry none (then `answer` is `[kind]`), `seen` what the payload shows of
    the stream's schema (`kvctl.server.ingest.schema_seen.facts_of`) when the stream's schema samples this
    message (`kvctl.server.ingest.schema_seen.sampled`), else nil.
  - origin 2 (`REFUSED`): the child could not subscribe for stream `key`: msgpack `[key, why]`; the
    stream reads its own socket, where the same error shows as it would have without a child.
  - origin 3 (`DROPPED`): libzmq dropped stream `key`'s connection for a frame over its limit, and the child
    connected again (`kvctl.zmq_limits`): msgpack `[key]`.
  - origin 4 (`PART`): the first events of the batch the next request or live answer carries, `PART_EVENTS`
    of them: msgpack `[events]`. A batch of more events is sent in parts, each read as it comes in.
Every event's hashes are packed: a bin of native-endian u64s (both ends are one machine), which the router reads
as an `array('Q')`, as its index keeps them, without an int per block at either end.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvctl.core.events import (
    TIER_VALUES,
    Cleared,
    DecodeError,
    EngineBatch,
    ErrorKind,
    EventData,
    Group,
    Rehash,
    Removed,
    Stored,
    Tier,
    decode_engine_batch,
    decode_topic,
    live_seq,
)
from kvctl.server.ingest.schema_seen import facts_of

HEADER = struct.Struct("<II")
ANSWER = struct.Struct("<IB")
CONTROL = 0
REQUEST, LIVE, REFUSED, DROPPED, PART = 0, 1, 2, 3, 4
PART_EVENTS = 1024
"""Events the router reads of a batch at once (~2 ms): one message of 100,000 events, read whole, held its loop
for ~0.2 s."""

_TIERS = {t.value: t for t in Tier}
_ENCODE = msgspec.msgpack.Encoder().encode
_DECODE = msgspec.msgpack.Decoder().decode
_CLEARED = Cleared()


Live = tuple[int, int | None, list[list[Any]] | None, EngineBatch | ErrorKind]
"""A live message the child received: (key, seq, schema facts seen, decoded batch or error kind), as on the wire.
A plain tuple, told from a request's answer by its type: one is built per engine message."""


@dataclass(frozen=True, slots=True)
class Refused:
    """The child could not subscribe for stream `key` (see the module docstring)."""

    key: int
    why: str


@dataclass(frozen=True, slots=True)
class Dropped:
    """Stream `key`'s connection was dropped for too large a frame, and made again (see the module docstring)."""

    key: int


def control(command: list[Any]) -> bytes:
    """A command request (`open` / `close`)."""
    body = _ENCODE(command)
    return HEADER.pack(len(body), CONTROL) + body


def read_control(payload: bytes) -> list[Any]:
    command: list[Any] = _DECODE(payload)
    return command


def split_requests(buf: bytearray) -> list[tuple[bytes, int]]:
    """Complete requests at the head of `buf` as (payload, block size); consumed bytes are removed."""
    out = []
    at = 0
    size = len(buf)
    while size - at >= HEADER.size:
        length, block_size = HEADER.unpack_from(buf, at)
        end = at + HEADER.size + length
        if end > size:
            break
        out.append((bytes(buf[at + HEADER.size:end]), block_size))
        at = end
    del buf[:at]
    return out


def answer(payload: bytes, block_size: int) -> bytes:
    """Decode one requested payload (a replayed batch: rare, so with every token id an inherited salt needs) and
    encode what the router needs of it."""
    inner, _ = _decoded(payload, block_size, keep_tokens=True)
    parts = _parts(inner)
    body = _ENCODE(inner)
    return parts + ANSWER.pack(len(body), REQUEST) + body


def live_answer(key: int, frames: list[bytes], block_size: int, sample: bool, keep_tokens: bool
                ) -> tuple[bytes, bool]:
    """Decode one live `[topic, seq, payload]` message of stream `key` the way the router would; and whether it
    stored salted blocks (from then on the stream's unsalted stores are sent with their token ids: `Rehash`)."""
    seq = live_seq(frames)
    salted = False
    if seq is None:
        inner: list[Any] = [ErrorKind.bad_batch.value]
    else:
        try:
            decode_topic(frames[0])
        except DecodeError as exc:
            inner = [exc.kind.value]
        else:
            inner, salted = _decoded(frames[2], block_size, keep_tokens)
    parts = _parts(inner)
    body = _ENCODE([key, seq, facts_of(frames[2]) if sample and seq is not None else None, inner])
    return parts + ANSWER.pack(len(body), LIVE) + body, salted


def _parts(inner: list[Any]) -> bytes:
    """A decoded batch's events but its last `PART_EVENTS` (or fewer) as `PART` answers, taken out of `inner`."""
    if len(inner) == 1 or len(inner[2]) <= PART_EVENTS:
        return b""
    events, out = inner[2], []
    cut = (len(events) - 1) // PART_EVENTS * PART_EVENTS
    for at in range(0, cut, PART_EVENTS):
        body = _ENCODE([events[at:at + PART_EVENTS]])
        out.append(ANSWER.pack(len(body), PART) + body)
    inner[2] = events[cut:]
    return b"".join(out)


def refused(key: int, why: str) -> bytes:
    body = _ENCODE([key, why])
    return ANSWER.pack(len(body), REFUSED) + body


def dropped(key: int) -> bytes:
    body = _ENCODE([key])
    return ANSWER.pack(len(body), DROPPED) + body


def decode_now(payload: bytes, block_size: int, keep_tokens: bool = False) -> EngineBatch | ErrorKind:
    """A payload decoded as the router takes it, here or in the decode process: removed hashes and
    stored local hashes packed; with `keep_tokens` (a stream that stores salted blocks, or a replay), or in a
    batch that stores salted blocks, unsalted stores with a parent keep their token ids (`Rehash`), to inherit
    a salt."""
    try:
        batch = decode_engine_batch(payload, default_block_size=block_size, packed=True, keep_tokens=keep_tokens)
    except DecodeError as exc:
        return exc.kind
    if not keep_tokens and any(type(e) is Stored and e.salt is not None for e in batch.events):
        # A stream's first salted batch: its own unsalted stores may continue the salted ones.
        return decode_engine_batch(payload, default_block_size=block_size, packed=True, keep_tokens=True)
    return batch


def _decoded(payload: bytes, block_size: int, keep_tokens: bool) -> tuple[list[Any], bool]:
    """A batch's answer body, and whether it stored salted blocks."""
    batch = decode_now(payload, block_size, keep_tokens)
    if isinstance(batch, ErrorKind):
        return [batch.value], False
    body = [batch.ts, batch.dp_rank, [_event(e) for e in batch.events], [e.kind.value for e in batch.errors]]
    if batch.filtered:
        body.append(batch.filtered)
    return body, any(type(e) is Stored and e.salt is not None for e in batch.events)


def _event(event: EventData) -> list[Any]:
    if type(event) is Stored:
        body: list[Any] = [0, event.parent_hash, _packed(event.block_hashes), _packed(event.tokens_hashes),
                           TIER_VALUES[event.tier]]
        if event.group is not None or event.salt is not None or event.cut is not None or event.rehash is not None:
            body += [event.group, event.salt, event.cut, event.cut_blocks, event.rehash]
        return body
    if type(event) is Removed:
        return [1, _packed(event.block_hashes), TIER_VALUES[event.tier]] if event.group is None else \
            [1, _packed(event.block_hashes), TIER_VALUES[event.tier], event.group]
    return [2]


def _packed(hashes: Sequence[int]) -> bytes:
    return (hashes if type(hashes) is array else array("Q", hashes)).tobytes()


Answer = EngineBatch | ErrorKind | Live | Refused | Dropped


def split_answers(buf: bytearray, held: list[EventData] | None = None) -> list[Answer]:
    """Complete answers at the head of `buf`, in order; consumed bytes are removed. `held`: the events of `PART`
    answers read so far, which the next batch answer begins with (kept by the caller from one read to the next)."""
    held = [] if held is None else held
    out: list[Answer] = []
    at = 0
    size = len(buf)
    with memoryview(buf) as view:
        while size - at >= ANSWER.size:
            length, origin = ANSWER.unpack_from(buf, at)
            start = at + ANSWER.size
            end = start + length
            if end > size:
                break
            body = _DECODE(view[start:end])
            if origin == LIVE:
                key, seq, sample, inner = body
                out.append((key, seq, sample, read_answer(inner, held)))
            elif origin == REFUSED:
                out.append(Refused(*body))
            elif origin == DROPPED:
                out.append(Dropped(*body))
            elif origin == PART:
                held += _events(body[0])
            else:
                out.append(read_answer(body, held))
            at = end
    del buf[:at]
    return out


def read_answer(body: list[Any], held: list[EventData] | None = None) -> EngineBatch | ErrorKind:
    """A batch answer, after the events of its parts (`held`, emptied)."""
    if len(body) == 1:
        return ErrorKind(body[0])
    ts, dp_rank, raw_events, kinds, *filtered = body
    events = _events(raw_events)
    if held:
        events = held + events
        held.clear()
    errors = [DecodeError(ErrorKind(kind), "", "") for kind in kinds]
    return EngineBatch(ts, dp_rank, events, errors, filtered[0] if filtered else [])


def _events(raw_events: list[Any]) -> list[EventData]:
    events: list[EventData] = []
    for raw in raw_events:
        tag = raw[0]
        if tag == 0:
            if len(raw) == 5:
                events.append(Stored(raw[1], array("Q", raw[2]), array("Q", raw[3]), _TIERS[raw[4]]))
            else:
                group = None if raw[5] is None else Group(*raw[5])
                rehash = None if raw[9] is None else Rehash(*raw[9])
                events.append(Stored(raw[1], array("Q", raw[2]), array("Q", raw[3]), _TIERS[raw[4]], group, raw[6],
                                     raw[7], raw[8], rehash))
        elif tag == 1:
            group = None if len(raw) == 3 else Group(*raw[3])
            events.append(Removed(array("Q", raw[1]), _TIERS[raw[2]], group))
        else:
            events.append(_CLEARED)
    return events
