"""The pipe protocol between the router and its decode process (`kvctl.server.decoder`).

Decoding an engine batch (msgpack, then one XXH3 per block of token ids) costs about twice what
applying it to the index does, so a router with a spare core decodes in a child process. What
crosses the pipe must be much cheaper to read than the payload it replaces: requests are the raw
payloads, answers are the decoded events as flat msgpack arrays of ints (no maps, no names).

Request:  u32 LE payload length, u32 LE block size, payload.
Answer:   u32 LE body length, body = msgpack `[ts, dp_rank, events, error kinds]` for a batch, or
          `[kind]` when the whole payload failed; events are `[0, parent, hashes, locals, tier]`
          (stored), `[1, hashes, tier]` (removed) or `[2]` (cleared).
Answers come back one per request, in request order.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

from kvctl.core.events import (
    Cleared,
    DecodeError,
    EngineBatch,
    ErrorKind,
    EventData,
    Removed,
    Stored,
    Tier,
    decode_engine_batch,
)

HEADER = struct.Struct("<II")
LENGTH = struct.Struct("<I")

_TIERS = {t.value: t for t in Tier}
_ENCODE = msgspec.msgpack.Encoder().encode
_DECODE = msgspec.msgpack.Decoder().decode
_CLEARED = Cleared()


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
    """Decode one payload and encode what the router needs of it (the child's whole job)."""
    try:
        batch = decode_engine_batch(payload, default_block_size=block_size)
    except DecodeError as exc:
        body = _ENCODE([exc.kind.value])
    else:
        body = _ENCODE([batch.ts, batch.dp_rank, [_event(e) for e in batch.events],
                        [e.kind.value for e in batch.errors]])
    return LENGTH.pack(len(body)) + body


def _event(event: EventData) -> list[Any]:
    if type(event) is Stored:
        return [0, event.parent_hash, event.block_hashes, event.tokens_hashes, event.tier.value]
    if type(event) is Removed:
        return [1, event.block_hashes, event.tier.value]
    return [2]


def split_answers(buf: bytearray) -> list[EngineBatch | ErrorKind]:
    """Complete answers at the head of `buf`; consumed bytes are removed."""
    out = []
    at = 0
    size = len(buf)
    with memoryview(buf) as view:
        while size - at >= LENGTH.size:
            (length,) = LENGTH.unpack_from(buf, at)
            end = at + LENGTH.size + length
            if end > size:
                break
            out.append(read_answer(_DECODE(view[at + LENGTH.size:end])))
            at = end
    del buf[:at]
    return out


def read_answer(body: list[Any]) -> EngineBatch | ErrorKind:
    if len(body) == 1:
        return ErrorKind(body[0])
    ts, dp_rank, raw_events, kinds = body
    events: list[EventData] = []
    for raw in raw_events:
        tag = raw[0]
        if tag == 0:
            events.append(Stored(raw[1], raw[2], raw[3], _TIERS[raw[4]]))
        elif tag == 1:
            events.append(Removed(raw[1], _TIERS[raw[2]]))
        else:
            events.append(_CLEARED)
    errors = [DecodeError(ErrorKind(kind), "", "") for kind in kinds]
    return EngineBatch(ts, dp_rank, events, errors)
