"""What an engine's payloads look like on the wire, sampled from a stream: `GET /v1/status`'s `schema`.

Re-reading a raw payload costs about as much as decoding it, so only some are looked at (`sampled`):
the stream's first 32 messages, then every 1024th. Whoever receives the messages decides, with the
stream's own message count: the router for the streams it reads, the decode process for those it
reads on the router's behalf. That one looks at the payload itself and sends what it saw (`facts_of`) along
with the decoded batch: re-reading a payload in the router cost it a tenth of its ingest at 1M pairs from
64 engines (their first 32 messages each), and the decode process has a core of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvctl.core.events import DecodeError
from kvctl.core.events.errors import parse_msgpack

__all__ = ["Schema", "SchemaSeen", "facts_of", "sampled"]

_FIRST = 32
_EVERY = 1024

_SCHEMA_EVENTS = 16
"""Events of a sampled batch looked at for `schema`."""

# Positions of fields in vLLM <= 0.23 positional events, counting the tag as position 0.
_POS_BLOCK_HASHES = 1
_POS_STORED_BLOCK_SIZE = 4
_POS_STORED_MEDIUM = 6
_POS_REMOVED_MEDIUM = 2


@dataclass(frozen=True, slots=True)
class SchemaSeen:
    """What the engine's payloads looked like (sampled): answers "which engine / which settings?".

    - `batch_shapes`: "array" (`[ts, events, dp_rank]`), "array2" (`[ts, events]`, old vLLM) or "map".
    - `event_shapes`: "map" (vLLM >= 0.24, SGLang) or "array" (vLLM <= 0.23 positional).
    - `hash_kinds`: "u64", "i64" (negative: SGLang), "bytes" (vLLM with int hashes off).
    - `block_sizes`, `media`: as sent by the engine (e.g. 16, "GPU", "CPU_PINNED").
    - `token_shapes`: "ids" (plain token ids) or "pairs" (SGLang's EAGLE `[t_i, t_i+1]` pairs); "lookahead" (vLLM's
      `lookahead_token_ids`) and "surplus" (more full blocks of token ids than hashes) say that the engine's
      hashes and token blocks do not pair one to one, so its hashes differ from other engines' by design.
    - `tiers`, `dp_ranks`: from every decoded batch (not sampled).
    """

    batch_shapes: frozenset[str] = frozenset()
    event_shapes: frozenset[str] = frozenset()
    hash_kinds: frozenset[str] = frozenset()
    block_sizes: frozenset[int] = frozenset()
    media: frozenset[str] = frozenset()
    tiers: frozenset[str] = frozenset()
    dp_ranks: frozenset[int] = frozenset()
    token_shapes: frozenset[str] = frozenset()


@dataclass(slots=True)
class Schema:
    """What a stream has seen so far; `snapshot()` is the frozen view its stats report."""

    batch_shapes: set[str] = field(default_factory=set)
    event_shapes: set[str] = field(default_factory=set)
    hash_kinds: set[str] = field(default_factory=set)
    block_sizes: set[int] = field(default_factory=set)
    media: set[str] = field(default_factory=set)
    tiers: set[str] = field(default_factory=set)
    dp_ranks: set[int] = field(default_factory=set)
    token_shapes: set[str] = field(default_factory=set)

    def snapshot(self) -> SchemaSeen:
        return SchemaSeen(
            frozenset(self.batch_shapes),
            frozenset(self.event_shapes),
            frozenset(self.hash_kinds),
            frozenset(self.block_sizes),
            frozenset(self.media),
            frozenset(self.tiers),
            frozenset(self.dp_ranks),
            frozenset(self.token_shapes),
        )

    def observe_payload(self, payload: bytes) -> None:
        """Record the wire shape of one raw payload; anything unexpected is simply not recorded."""
        try:
            raw = parse_msgpack(payload)
        except DecodeError:
            return
        if isinstance(raw, dict):
            self.batch_shapes.add("map")
            events = raw.get("events")
        elif isinstance(raw, list) and len(raw) >= 2:
            self.batch_shapes.add("array" if len(raw) > 2 else "array2")
            events = raw[1]
        else:
            return
        if not isinstance(events, list):
            return
        for event in events[:_SCHEMA_EVENTS]:
            self._observe_event(event)

    def sampled_facts(self) -> list[list[Any]]:
        """What sampling recorded, in plain lists (msgpack-able): `merge_facts` adds them to another schema."""
        return [sorted(self.batch_shapes), sorted(self.event_shapes), sorted(self.hash_kinds),
                sorted(self.block_sizes), sorted(self.media), sorted(self.token_shapes)]

    def merge_facts(self, facts: list[list[Any]]) -> None:
        batch_shapes, event_shapes, hash_kinds, block_sizes, media, token_shapes = facts
        self.token_shapes.update(token_shapes)
        self.batch_shapes.update(batch_shapes)
        self.event_shapes.update(event_shapes)
        self.hash_kinds.update(hash_kinds)
        self.block_sizes.update(block_sizes)
        self.media.update(media)

    def _observe_event(self, event: Any) -> None:
        if isinstance(event, dict):
            self.event_shapes.add("map")
            tag = event.get("type")
            hashes, block_size, medium = event.get("block_hashes"), event.get("block_size"), event.get("medium")
        elif isinstance(event, list) and event:
            self.event_shapes.add("array")
            tag = event[0]
            hashes = _at(event, _POS_BLOCK_HASHES)
            block_size = _at(event, _POS_STORED_BLOCK_SIZE) if tag == "BlockStored" else None
            medium = _at(event, _POS_STORED_MEDIUM if tag == "BlockStored" else _POS_REMOVED_MEDIUM)
        else:
            return
        if tag == "AllBlocksCleared":
            return
        if isinstance(hashes, list) and hashes:
            first = hashes[0]
            if isinstance(first, bytes):
                self.hash_kinds.add("bytes")
            elif type(first) is int:
                self.hash_kinds.add("i64" if first < 0 else "u64")
        if tag == "BlockStored" and type(block_size) is int:
            self.block_sizes.add(block_size)
        tokens = event.get("token_ids") if tag == "BlockStored" and isinstance(event, dict) else None
        if isinstance(tokens, list) and tokens:
            pairs = isinstance(tokens[0], list)
            self.token_shapes.add("pairs" if pairs else "ids")
            if event.get("lookahead_token_ids"):
                self.token_shapes.add("lookahead")
            if not pairs and isinstance(hashes, list) and type(block_size) is int and block_size > 0 and \
                    len(tokens) // block_size > len(hashes):
                self.token_shapes.add("surplus")
        if isinstance(medium, str):
            self.media.add(medium)


def _at(items: list[Any], index: int) -> Any:
    return items[index] if index < len(items) else None


def facts_of(payload: bytes) -> list[list[Any]]:
    """What one payload shows of its stream's schema (`Schema.sampled_facts`), for the stream to merge."""
    schema = Schema()
    schema.observe_payload(payload)
    return schema.sampled_facts()


def sampled(messages: int) -> bool:
    """Whether a stream's `messages`-th message (counting from 1) is looked at for its schema."""
    return messages <= _FIRST or messages % _EVERY == 0
