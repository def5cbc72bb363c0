"""Engine ZMQ payloads written exactly as vLLM's and SGLang's own publishers write them (docs/contract.md).

The inverse of `engine.py`, for the mock engines: a router under test must see the bytes a real
engine sends, so every shape detail is kept, not just the meaning. The details that differ
between producers live in one `WireFormat` per producer:

- vLLM 0.33 (`VLLM`): tagged maps, "type" first, then fields in struct order; `omit_defaults`
  leaves out optional fields that are None, while lora_id, medium and lora_name have no default
  and are always sent; the batch `[ts, events, dp_rank]` drops a None dp_rank the same way.
- vLLM <= 0.23 (`VLLM_LEGACY`, and `VLLM_LEGACY_0_10` for 0.10): positional tagged arrays whose
  length is fixed per version; trailing Nones are still sent.
- SGLang 0.5.23 (`SGLANG`): tagged maps with lora_id and medium always sent and cache_salt,
  session_id, lora_name only when set; the batch always has its third field.

Fields this module does not name go in an event's `extra` mapping and are placed where the
producer's struct puts them (or appended, for a map format that has never heard of them), so
any captured payload can be rebuilt byte for byte. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvctl.core.events.types import Tier

_ENCODER = msgspec.msgpack.Encoder()

BlockHash = int | bytes
"""An engine block hash: an int (u64, or SGLang's signed i64) or a raw digest."""

_COMMON_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks an engine has just cached; `extra` carries producer-specific fields by wire name."""

    block_hashes: Sequence[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks an engine has evicted from `medium`."""

    block_hashes: Sequence[BlockHash]
    medium: str | None = "GPU"
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (vLLM's reset_prefix_cache)."""


EngineEvent = BlockStored | BlockRemoved | AllBlocksCleared

_TAGS = {BlockStored: "BlockStored", BlockRemoved: "BlockRemoved", AllBlocksCleared: "AllBlocksCleared"}


@dataclass(frozen=True, slots=True)
class Schema:
    """One event type's fields after the tag, in the producer's struct order; `always` are sent even when None."""

    fields: tuple[str, ...]
    always: frozenset[str]


@dataclass(frozen=True, slots=True)
class WireFormat:
    """Everything that differs between two producers' payloads for the same events."""

    name: str
    positional: bool
    """Events are tagged arrays (vLLM <= 0.23, `array_like=True`) instead of tagged maps."""
    stored: Schema
    removed: Schema
    dp_rank_always: bool
    """SGLang sends a None dp rank; vLLM's `omit_defaults` drops it from the batch."""
    kv_groups: bool
    """The producer tags events with a KV-cache group and per-block extra_keys (vLLM >= 0.2x)."""
    replay_topic: bool
    """Replay replies carry a topic frame (vLLM >= 0.26, SGLang); older vLLM sends [seq, payload]."""
    mediums: Mapping[Tier, str]
    """The `medium` string the producer writes for each tier."""

    def plain_stored_extra(self, n_blocks: int) -> dict[str, Any]:
        """What the producer adds to a BlockStored of a plain-text request (no LoRA, no multimodal)."""
        return {"extra_keys": [None] * n_blocks, "group_idx": 0} if self.kv_groups else {}

    def plain_removed_extra(self) -> dict[str, Any]:
        """What the producer adds to a BlockRemoved of the main KV-cache group."""
        return {"group_idx": 0} if self.kv_groups else {}


def _schema(fields: Sequence[str], always: Sequence[str]) -> Schema:
    return Schema(tuple(fields), frozenset(always))


_VLLM_STORED_FIELDS = (
    *_COMMON_STORED,
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)
_VLLM_MEDIUMS = {Tier.device: "GPU", Tier.host_pinned: "CPU", Tier.disk: "DISK"}

VLLM = WireFormat(
    name="vllm",
    positional=False,
    stored=_schema(_VLLM_STORED_FIELDS, (*_COMMON_STORED, "lora_name")),
    removed=_schema(("block_hashes", "medium", "group_idx", "locality", "ownership"), ("block_hashes", "medium")),
    dp_rank_always=False,
    kv_groups=True,
    replay_topic=True,
    mediums=_VLLM_MEDIUMS,
)
"""vLLM 0.33 (map-encoded events, since vLLM 0.24)."""

_LEGACY_STORED = _VLLM_STORED_FIELDS[:11]  # up to kv_cache_spec_sliding_window
VLLM_LEGACY = WireFormat(
    name="vllm-legacy",
    positional=True,
    stored=_schema(_LEGACY_STORED, _LEGACY_STORED),
    removed=_schema(("block_hashes", "medium", "group_idx"), ("block_hashes", "medium", "group_idx")),
    dp_rank_always=False,
    kv_groups=True,
    replay_topic=False,
    mediums=_VLLM_MEDIUMS,
)
"""vLLM 0.23, the last release with positional (array_like) events."""

VLLM_LEGACY_0_10 = WireFormat(
    name="vllm-legacy-0.10",
    positional=True,
    stored=_schema(_COMMON_STORED, _COMMON_STORED),
    removed=_schema(("block_hashes", "medium"), ("block_hashes", "medium")),
    dp_rank_always=False,
    kv_groups=False,
    replay_topic=False,
    mediums=_VLLM_MEDIUMS,
)
"""vLLM 0.10: positional events without lora_name, extra_keys or KV-cache groups."""

SGLANG = WireFormat(
    name="sglang",
    positional=False,
    stored=_schema((*_COMMON_STORED, "cache_salt", "session_id", "lora_name"), _COMMON_STORED),
    removed=_schema(("block_hashes", "medium"), ("block_hashes", "medium")),
    dp_rank_always=True,
    kv_groups=False,
    replay_topic=True,
    mediums={Tier.device: "GPU", Tier.host_pinned: "CPU_PINNED", Tier.disk: "DISK"},
)
"""SGLang 0.5.23 in its default event format."""

FORMATS: Mapping[str, WireFormat] = {f.name: f for f in (VLLM, VLLM_LEGACY, VLLM_LEGACY_0_10, SGLANG)}
"""Every format by name; `vllm`, `vllm-legacy` and `sglang` are the ones the mock engines offer."""


def encode_batch(fmt: WireFormat, ts: float, events: Sequence[EngineEvent], dp_rank: int | None = 0) -> bytes:
    """The payload frame of one ZMQ message: msgpack of `[ts (float64), events, dp_rank]`."""
    batch: list[Any] = [float(ts), [msgspec.Raw(encode_event(fmt, event)) for event in events]]
    if dp_rank is not None or fmt.dp_rank_always:
        batch.append(dp_rank)
    return _ENCODER.encode(batch)


def encode_event(fmt: WireFormat, event: EngineEvent) -> bytes:
    """One event as the producer's msgpack: a tagged array, or a tagged map."""
    tag = _TAGS[type(event)]
    if isinstance(event, AllBlocksCleared):
        return _ENCODER.encode([tag] if fmt.positional else {"type": tag})
    schema = fmt.stored if isinstance(event, BlockStored) else fmt.removed
    values = _field_values(event)
    unknown = [name for name, value in values.items() if name not in schema.fields and value is not None]
    if fmt.positional:
        if unknown:
            raise ValueError(f"{fmt.name} events are positional and have no field {unknown[0]!r}")
        return _ENCODER.encode([tag, *(values.get(name) for name in schema.fields)])
    sent = [name for name in schema.fields if values.get(name) is not None or name in schema.always]
    items = [("type", tag), *((name, values.get(name)) for name in (*sent, *unknown))]
    body = b"".join(_ENCODER.encode(key) + _ENCODER.encode(value) for key, value in items)
    return _map_header(len(items), capacity=1 + len(schema.fields) + len(unknown)) + body


def _map_header(count: int, capacity: int) -> bytes:
    """A msgpack map header as msgspec writes it for a Struct with `omit_defaults`.

    msgspec sizes the header for every field the struct could send (tag included) and fills in the
    count afterwards, so vLLM's 15-field BlockStored gets a map16 header even with 9 entries.
    """
    if capacity < 16:
        return bytes([0x80 | count])
    if capacity < 1 << 16:
        return b"\xde" + count.to_bytes(2, "big")
    return b"\xdf" + count.to_bytes(4, "big")


def _field_values(event: BlockStored | BlockRemoved) -> dict[str, Any]:
    """The event's named fields, then its extras, by wire name (extras may not shadow a named field).

    A None is an absent optional field: a format without that field simply does not send it.
    """
    if isinstance(event, BlockStored):
        named: dict[str, Any] = {
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
    else:
        named = {"block_hashes": list(event.block_hashes), "medium": event.medium}
    clash = named.keys() & event.extra.keys()
    if clash:
        raise ValueError(f"extra field {sorted(clash)[0]!r} is a named field of {_TAGS[type(event)]}")
    return {**named, **event.extra}
