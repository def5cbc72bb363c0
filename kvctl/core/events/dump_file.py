"""RouterEvents from a file in any of the shapes they are kept in: a JSON list (a dump), JSON
lines (`/v1/tree?format=jsonl`, a kvctl snapshot's event lines), or Dynamo's recorder lines
(`{"timestamp": ms, "event": RouterEvent}`). The shape is told from the text, never from a file name.

A recording made with `events record --decisions` also holds the routers' decisions, one per line as
`{"timestamp": ms, "decision": ActiveSequenceEvent}` (serde's JSON of what replica sync publishes): only
`read_timed_events` (what `events replay` reads) returns them; the readers of events alone refuse them by line.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Annotated, Any, TypeVar

import msgspec

from kvctl.core.events.dynamo import decode_router_event_json
from kvctl.core.events.errors import DecodeError
from kvctl.core.events.plane import ActiveSequenceEvent, sequence_event_of
from kvctl.core.events.types import RouterEvent, Stored, Tier

Recorded = RouterEvent | ActiveSequenceEvent
T = TypeVar("T")


class DumpFileError(ValueError):
    """The text is not events in any known shape; says where (line n) and what."""


def read_router_events(text: str) -> list[RouterEvent]:
    return [event for _, event in _read(text, _event)]


def read_timed_events(text: str) -> list[tuple[int | None, Recorded]]:
    """Each event, and each decision of a recording made with `--decisions`, in the file's order, with its
    recorder timestamp (ms), None where the shape has none."""
    return _read(text, _recorded)


def _read(text: str, item_of: Callable[[Any, str], tuple[int | None, T]]) -> list[tuple[int | None, T]]:
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            items = json.loads(stripped)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
            raise DumpFileError(f"not a JSON list of RouterEvents: {exc}") from None
        return [item_of(item, f"item {n}") for n, item in enumerate(items)]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise DumpFileError(f"line {n} is not JSON: {exc}") from None
        out.append(item_of(item, f"line {n}"))
    return out


def _recorded(item: Any, where: str) -> tuple[int | None, Recorded]:
    return _decision(item, where) if _is_decision(item) else _event(item, where)


def _is_decision(item: Any) -> bool:
    return isinstance(item, dict) and "decision" in item and "event" not in item


def _decision(item: dict[str, Any], where: str) -> tuple[int | None, ActiveSequenceEvent]:
    timestamp = item.get("timestamp")
    try:
        return timestamp if isinstance(timestamp, int) else None, sequence_event_of(item["decision"])
    except DecodeError as exc:
        raise DumpFileError(f"{where}: decision.{exc.field}: {exc.detail}") from None


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


def router_event_of(item: dict[str, Any]) -> RouterEvent:
    """`decode_router_event_json` of one decoded JSON object, a dump's Stored the fast way."""
    try:
        event = msgspec.convert(item, _DumpedStored, strict=True).router_event()
    except msgspec.ValidationError:
        event = None
    return decode_router_event_json(item) if event is None else event


def _event(item: Any, where: str) -> tuple[int | None, RouterEvent]:
    if _is_decision(item):
        raise DumpFileError(f"{where} is a routing decision (a recording made with `events record --decisions`): "
                            "only `kvctl events replay` sends decisions")
    timestamp = None
    if isinstance(item, dict) and "event" in item and "worker_id" not in item:
        timestamp = item.get("timestamp") if isinstance(item.get("timestamp"), int) else None
        item = item["event"]  # a recorder line, or a kvctl snapshot line ({"model", "event"})
    if not isinstance(item, dict):
        raise DumpFileError(f"{where}: expected a RouterEvent object, got {type(item).__name__}")
    try:
        return timestamp, router_event_of(item)
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
_DECODER = json.JSONDecoder()


class _Text:
    """JSON text arriving in pieces, read a value at a time; what is read is let go. `what` names the text
    in errors."""

    def __init__(self, pieces: Iterable[str], what: str) -> None:
        self.pieces, self.what = iter(pieces), what
        self.buf, self.pos = "", 0

    def peek(self) -> str | None:
        """The next character that is not blank; None at the end."""
        while True:
            self.pos = _BLANK.match(self.buf, self.pos).end()  # type: ignore[union-attr]  # \s* always matches
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            piece = next(self.pieces, None)
            if piece is None:
                return None
            self.buf, self.pos = piece, 0

    def take(self, char: str) -> None:
        found = self.peek()
        if found is None:
            raise DumpFileError(f"{self.what}: it never ends")
        if found != char:
            raise DumpFileError(f"{self.what}: {found!r} where {char!r} belongs")
        self.pos += 1

    def value(self) -> Any:
        """One whole JSON value (decoded once whole: a piece's end cuts none)."""
        self.peek()
        while True:
            try:
                item, end = _DECODER.raw_decode(self.buf, self.pos)
                if end < len(self.buf) or type(item) not in (int, float):  # a number may go on in the next piece
                    self.pos = end
                    return item
                failure: Exception | None = None
            except (ValueError, RecursionError) as exc:  # cut off by the piece's end, or not JSON
                failure = exc
            more = self._more(len(self.buf) - self.pos)
            if not more:
                if failure is not None:
                    raise DumpFileError(f"{self.what}: {failure}") from None
                self.pos = end
                return item
            self.buf, self.pos = self.buf[self.pos:] + more, 0

    def _more(self, pending: int) -> str:
        """At least as much text again as `pending` (all that is left, if less): a value many pieces long is
        decoded again a few times, not once per piece."""
        pieces: list[str] = []
        got = 0
        while got <= pending:
            piece = next(self.pieces, None)
            if piece is None:
                break
            pieces.append(piece)
            got += len(piece)
        return "".join(pieces)

    def items(self) -> Iterator[Any]:
        """A JSON list's items: `[`, items separated by `,`, `]`."""
        self.take("[")
        if self.peek() == "]":
            self.pos += 1
            return
        while True:
            yield self.value()
            if self.peek() == "]":
                self.pos += 1
                return
            self.take(",")

    def members(self) -> Iterator[str]:
        """A JSON object's keys, each yielded with the text at its value, which the caller reads (or skips)."""
        self.take("{")
        if self.peek() == "}":
            self.pos += 1
            return
        while True:
            key = self.value()
            if not isinstance(key, str):
                raise DumpFileError(f"{self.what}: a key that is not a string")
            self.take(":")
            yield key
            if self.peek() == "}":
                self.pos += 1
                return
            self.take(",")


def _list_items(pieces: Iterable[str]) -> Iterator[Any]:
    return _Text(pieces, "not a JSON list of RouterEvents").items()


def iter_indexer_dump(chunks: Iterable[str]) -> Iterator[tuple[str, Iterator[Any]]]:
    """Dynamo's standalone indexer's `GET /dump`, `{"model:routing_group": {"events": [...]}, ...}`, arriving in
    pieces: each model with its events (JSON objects), as they come; read a model's events (or not) before
    the next model. Empty text is no model."""
    text = _Text(chunks, "not a Dynamo indexer dump")
    if text.peek() is None:
        return
    if text.peek() != "{":
        raise DumpFileError("not a Dynamo indexer dump (expected an object by model)")
    for model in text.members():
        if text.peek() != "{":
            raise DumpFileError(f"model {model!r} without an events list")
        events = _model_events(text, model)
        yield model, events
        for _ in events:  # what the caller left unread
            pass


def _model_events(text: _Text, model: str) -> Iterator[Any]:
    listed = False
    for key in text.members():
        if key == "events" and not listed:
            listed = True
            yield from text.items()
        else:
            text.value()
    if not listed:
        raise DumpFileError(f"model {model!r} without an events list")
