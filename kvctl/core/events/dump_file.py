"""RouterEvents from a file in any of the shapes they are kept in: a JSON list (a dump), JSON
lines (`/v1/tree?format=jsonl`, a kvctl snapshot's event lines), or Dynamo's recorder lines
(`{"timestamp": ms, "event": RouterEvent}`). The shape is told from the text, never from a file name.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable, Iterator
from typing import Annotated, Any

import msgspec

from kvctl.core.events.dynamo import decode_router_event_json
from kvctl.core.events.errors import DecodeError
from kvctl.core.events.types import RouterEvent, Stored, Tier


class DumpFileError(ValueError):
    """The text is not events in any known shape; says where (line n) and what."""


def read_router_events(text: str) -> list[RouterEvent]:
    return [event for _, event in read_timed_events(text)]


def read_timed_events(text: str) -> list[tuple[int | None, RouterEvent]]:
    """Each event with its recorder timestamp (ms), None where the shape has none."""
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            items = json.loads(stripped)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
            raise DumpFileError(f"not a JSON list of RouterEvents: {exc}") from None
        return [_event(item, f"item {n}") for n, item in enumerate(items)]
    events = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise DumpFileError(f"line {n} is not JSON: {exc}") from None
        events.append(_event(item, f"line {n}"))
    return events


_U64_MAX = (1 << 64) - 1
_U64 = Annotated[int, msgspec.Meta(ge=0)]  # and at most _U64_MAX, checked after (msgspec bounds are int64)


class _Block(msgspec.Struct, gc=False):
    block_hash: _U64
    tokens_hash: _U64


class _StoredBody(msgspec.Struct, gc=False):
    blocks: list[_Block]
    parent_hash: _U64 | None = None


class _StoredData(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    stored: _StoredBody


class _StoredEvent(msgspec.Struct, gc=False):
    event_id: _U64
    data: _StoredData
    dp_rank: Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 1)] = 0


class _DumpedStored(msgspec.Struct, gc=False):
    """A dump's one kind of event, a Stored RouterEvent, decoded in C: the same rules as
    `decode_router_event_json` (unsigned ints, no bools or floats), five times as fast. Anything else (another
    event, a recorder line, an error to name) takes `decode_router_event_json`'s way."""

    worker_id: _U64
    event: _StoredEvent
    storage_tier: Tier = Tier.device

    def router_event(self) -> RouterEvent | None:
        """The event; None when an int is past u64 (the general way names it)."""
        body, event = self.event.data.stored, self.event
        block_hashes = [b.block_hash for b in body.blocks]
        tokens_hashes = [b.tokens_hash for b in body.blocks]
        if max(self.worker_id, event.event_id, body.parent_hash or 0, max(block_hashes, default=0),
               max(tokens_hashes, default=0)) > _U64_MAX:
            return None
        return RouterEvent(self.worker_id, Stored(body.parent_hash, block_hashes, tokens_hashes, self.storage_tier),
                           event.dp_rank, event.event_id)


_STORED_LINE = msgspec.json.Decoder(_DumpedStored)


def _line_event(line: str, n: int) -> RouterEvent:
    try:
        event = _STORED_LINE.decode(line).router_event()
    except msgspec.DecodeError:  # not a Stored RouterEvent as a dump has it: the general way says what it is
        event = None
    if event is not None:
        return event
    try:
        item = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise DumpFileError(f"line {n} is not JSON: {exc}") from None
    return _event(item, f"line {n}")[1]


def _event(item: Any, where: str) -> tuple[int | None, RouterEvent]:
    if isinstance(item, dict) and "worker_id" in item:
        try:
            event = msgspec.convert(item, _DumpedStored, strict=True).router_event()
        except msgspec.ValidationError:
            event = None
        if event is not None:
            return None, event
    timestamp = None
    if isinstance(item, dict) and "event" in item and "worker_id" not in item:
        timestamp = item.get("timestamp") if isinstance(item.get("timestamp"), int) else None
        item = item["event"]  # a recorder line, or a kvctl snapshot line ({"model", "event"})
    if not isinstance(item, dict):
        raise DumpFileError(f"{where}: expected a RouterEvent object, got {type(item).__name__}")
    try:
        return timestamp, decode_router_event_json(item)
    except DecodeError as exc:
        raise DumpFileError(f"{where}: {exc.field}: {exc.detail}") from None


def iter_dump_events(chunks: Iterable[str]) -> Iterator[RouterEvent]:
    """`read_router_events` for text arriving in pieces (a file read a chunk at a time): each event as soon as
    it is whole, so a reader of a dump of any size holds one event and one piece at a time."""
    pieces = iter(chunks)
    head = ""
    for piece in pieces:
        head += piece
        if head.strip():
            break
    rest = itertools.chain([head], pieces)
    if head.lstrip().startswith("["):
        for n, item in enumerate(_list_items(rest)):
            yield _event(item, f"item {n}")[1]
        return
    for n, line in enumerate(_lines(rest), 1):
        if line.strip():
            yield _line_event(line, n)


def _lines(pieces: Iterable[str]) -> Iterator[str]:
    tail = ""
    for piece in pieces:
        *lines, tail = (tail + piece).split("\n")
        yield from lines
    yield tail


_BLANK = re.compile(r"\s*")


def _list_items(pieces: Iterator[str]) -> Iterator[Any]:
    """The items of one JSON list, each decoded once whole: `[`, items separated by `,`, `]`."""
    decoder = json.JSONDecoder()
    buf, pos, expect = "", 0, "["
    while True:
        pos = _BLANK.match(buf, pos).end()  # type: ignore[union-attr]  # \s* always matches
        if pos == len(buf):
            piece = next(pieces, None)
            if piece is None:
                raise DumpFileError("not a JSON list of RouterEvents: it never ends")
            buf, pos = buf[pos:] + piece, 0
            continue
        char = buf[pos]
        if expect == "[" or expect == ",":
            if char == "]" and expect == ",":
                return
            if char != expect:
                raise DumpFileError(f"not a JSON list of RouterEvents: {char!r} where {expect!r} belongs")
            pos, expect = pos + 1, "first" if expect == "[" else "item"
            continue
        if char == "]" and expect == "first":
            return
        try:
            item, pos = decoder.raw_decode(buf, pos)
        except (ValueError, RecursionError) as exc:  # cut off by the piece's end, or not JSON
            piece = next(pieces, None)
            if piece is None:
                raise DumpFileError(f"not a JSON list of RouterEvents: {exc}") from None
            buf, pos = buf[pos:] + piece, 0
            continue
        yield item
        expect = ","
