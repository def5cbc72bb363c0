"""Engine KV events as vLLM and SGLang publish them on ZMQ (docs/contract.md), decoded into kvctl's model.

Three generations of the same events reach a router: vLLM ≤ 0.23 sends positional tagged arrays,
vLLM ≥ 0.24 and SGLang send tagged maps, and hashes arrive as u64, signed i64 (SGLang) or raw
digest bytes (vLLM with int hashes off). All of them decode through one walk over the untyped
msgpack value, so a new engine field never breaks decoding and a bad event costs only itself:
it is reported in `EngineBatch.errors` and the rest of its batch still applies. The shape nearly
every batch has is first tried with a typed pass that gives the same answer faster, or gives up.

Each `Stored` gets its `tokens_hashes` from the event's own token ids (Dynamo's local hash, with
the LoRA name folded into the seed as Dynamo does); the engine's block hash stays an opaque id.
Multimodal/cache-salt `extra_keys` are ignored for the local hash, as Dynamo 1.6.1's indexer does.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from kvctl.core import native
from kvctl.core.events.errors import DecodeError, ErrorKind, describe, parse_msgpack, require
from kvctl.core.events.types import Cleared, EventData, Removed, Stored, Tier
from kvctl.core.hashing import U64_MASK, block_hashes_of_packed, local_block_hashes
from kvctl.core.words import counted

END_SEQ = U64_MASK
"""The seq of the replay end marker (vLLM's END_SEQ = -1 as 8 unsigned big-endian bytes)."""

_I64_MIN = -(1 << 63)
_U32_LIMIT = 1 << 32

_MEDIUM_TIERS = {
    "GPU": Tier.device,
    "DEVICE": Tier.device,
    "CPU": Tier.host_pinned,
    "CPU_PINNED": Tier.host_pinned,
    "CPU_TIER1": Tier.host_pinned,
    "DISK": Tier.disk,
    "STORAGE": Tier.disk,
    "NVME": Tier.disk,
    "CPU_TIER2": Tier.disk,
    "EXTERNAL": Tier.external,
    "REMOTE": Tier.external,
    "NETWORK": Tier.external,
    "SHARED": Tier.external,
}

# Field names of the positional (vLLM <= 0.23, array_like=True) events, after the tag. Later
# positions (extra_keys, group_idx, ...) are not needed and ignored; older versions send fewer.
_POSITIONAL_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


class EngineBatch(msgspec.Struct, frozen=True, gc=False):
    """One decoded payload: the events that decoded, in order, and one error per event that did not.

    A Struct, as the events are: a router builds one per engine message, where a frozen dataclass
    costs several times as much to construct."""

    ts: float
    dp_rank: int
    events: list[EventData]
    errors: list[DecodeError]


@dataclass(frozen=True, slots=True)
class EngineMessage:
    """One live ZMQ message: `seq` lets a subscriber detect gaps and ask for a replay."""

    topic: str
    seq: int
    batch: EngineBatch


@dataclass(frozen=True, slots=True)
class ReplayFrame:
    """One reply on the replay socket: a buffered batch (payload still encoded) or the end marker.

    `topic` is None for replies of engines that send no topic frame (vLLM < 0.26).
    """

    seq: int
    topic: str | None
    payload: bytes | None
    end: bool


def normalize_hash(value: object, field: str) -> int:
    """An engine block hash as u64: ints are bit-cast from i64/u64; bytes give their last 8 bytes, big-endian.

    The bytes rule is vLLM's own int form of a digest, so one block reads the same whichever
    `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` the engine ran with.
    """
    if type(value) is int:
        if _I64_MIN <= value <= U64_MASK:
            return value & U64_MASK
        raise DecodeError(ErrorKind.bad_hash, field, f"{value} is outside [-2^63, 2^64)")
    if isinstance(value, bytes) and value:
        return int.from_bytes(value[-8:], "big")
    raise DecodeError(ErrorKind.bad_hash, field, f"expected an int or bytes, got {describe(value)}")


def tier_from_medium(medium: object) -> Tier:
    """The tier of an engine `medium` (case-insensitive); no medium means the GPU, as in early vLLM."""
    if medium is None:
        return Tier.device
    tier = _MEDIUM_TIERS.get(medium.upper()) if isinstance(medium, str) else None
    if tier is None:
        raise DecodeError(ErrorKind.bad_tier, "medium", f"unknown medium {describe(medium)}")
    return tier


def decode_engine_message(frames: Sequence[bytes], *, default_block_size: int | None = None) -> EngineMessage:
    """Decode one live multipart message `[topic, seq (u64 BE), payload]`; other shapes are bad_batch."""
    if len(frames) != 3:
        raise DecodeError(
            ErrorKind.bad_batch, "frames", f"expected 3 frames [topic, seq, payload], got {len(frames)}"
        )
    topic, seq, payload = frames
    return EngineMessage(
        decode_topic(topic),
        _decode_seq(seq),
        decode_engine_batch(payload, default_block_size=default_block_size),
    )


def decode_engine_batch(payload: bytes, *, default_block_size: int | None = None,
                        packed: bool = False) -> EngineBatch:
    """Decode a batch payload; raises DecodeError only when the batch itself is unusable.

    `default_block_size` is used only for events that carry no block size of their own. With `packed`, a
    removal's hashes and a store's local hashes may come as an array('Q') (the router's decode process sends
    them packed, and reads them so from the common shape without an int per block).
    """
    batch = _decode_common(payload, default_block_size, packed)
    return _decode_any(payload, default_block_size) if batch is None else batch


# The typed pass declares every field vLLM 0.33 and SGLang 0.5 send and forbids the others: a field it
# does not know would be skipped unread, where the walk reads it (and refuses the payload if it is not
# even valid msgpack), so an event with an unknown field goes to the walk. Fields kvctl ignores are Any.
class _StoredMap(msgspec.Struct, tag_field="type", tag="BlockStored", forbid_unknown_fields=True):
    block_hashes: list[Annotated[int, msgspec.Meta(ge=0)]]
    token_ids: msgspec.Raw  # read by `_packed_local_hashes`, without an int per token
    parent_block_hash: Annotated[int, msgspec.Meta(ge=0)] | None = None
    block_size: Any = None
    lora_name: Any = None
    medium: Any = None
    lora_id: Any = None
    extra_keys: Any = None
    group_idx: Any = None
    kv_cache_spec_kind: Any = None
    locality: Any = None
    session_id: Any = None


class _RemovedMap(msgspec.Struct, tag_field="type", tag="BlockRemoved", forbid_unknown_fields=True):
    block_hashes: msgspec.Raw  # read by `_removed_hashes`, without an int per block where it may stay packed
    medium: Any = None
    group_idx: Any = None
    locality: Any = None


class _ClearedMap(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", forbid_unknown_fields=True):
    group_idx: Any = None
    locality: Any = None


class _CommonBatch(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    ts: int | float
    events: list[_StoredMap | _RemovedMap | _ClearedMap]
    dp_rank: Annotated[int, msgspec.Meta(ge=0, lt=_U32_LIMIT)] | None = None


_COMMON = msgspec.msgpack.Decoder(_CommonBatch)


def _decode_common(payload: bytes, default_block_size: int | None, packed: bool = False) -> EngineBatch | None:
    """The shape nearly every batch has (vLLM >= 0.24: `[ts, events, dp_rank]` of map events with u64
    hashes, every event sound), decoded by one typed msgspec pass instead of a walk over untyped values,
    token ids and removed hashes read by C straight from their msgpack (a 1024-token store: 17 us here,
    42 us when msgspec made an int of each id). None for anything else,
    which `_decode_any` then decodes and reports; the fields the typed pass does not check go through the
    same helpers as there, so the two agree on every payload this one accepts (a property test holds
    them to it)."""
    try:
        raw = _COMMON.decode(payload)
        events: list[EventData] = []
        for event in raw.events:
            if type(event) is _RemovedMap:
                events.append(Removed(_removed_hashes(event.block_hashes, packed),
                                      tier_from_medium(event.medium)))
            elif type(event) is _StoredMap:
                hashes = event.block_hashes
                events.append(Stored(event.parent_block_hash, hashes,
                                     _packed_local_hashes(event.token_ids, len(hashes),
                                                          _block_size(event.block_size, default_block_size),
                                                          event.lora_name, packed),
                                     tier_from_medium(event.medium)))
            else:
                events.append(Cleared())
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError, DecodeError):
        return None  # not the common shape, or not sound: the general walk says why
    return EngineBatch(float(raw.ts), 0 if raw.dp_rank is None else raw.dp_rank, events, [])


def _decode_any(payload: bytes, default_block_size: int | None) -> EngineBatch:
    """Every shape a batch may have, each event decoded (or reported) on its own."""
    ts, raw_events, dp_rank = _batch_parts(parse_msgpack(payload))
    events: list[EventData] = []
    errors: list[DecodeError] = []
    for index, raw in enumerate(raw_events):
        try:
            events.append(_decode_event(raw, default_block_size))
        except DecodeError as exc:
            errors.append(DecodeError(exc.kind, exc.field, exc.detail, index))
    return EngineBatch(ts, dp_rank, events, errors)


def decode_replay_reply(frames: Sequence[bytes]) -> ReplayFrame:
    """Decode one reply of an engine's replay ROUTER socket, as received on a DEALER.

    `[b"", topic, seq, payload]` (vLLM >= 0.26, SGLang) or `[b"", seq, payload]` (older vLLM);
    seq END_SEQ with an empty payload ends the replay. The payload is left for decode_engine_batch.
    """
    if len(frames) == 4:
        delimiter, topic_frame, seq_frame, payload = frames
        topic: str | None = decode_topic(topic_frame)
    elif len(frames) == 3:
        delimiter, seq_frame, payload = frames
        topic = None
    else:
        raise DecodeError(ErrorKind.bad_batch, "frames", f"expected 3 or 4 replay frames, got {len(frames)}")
    if delimiter:
        raise DecodeError(ErrorKind.bad_batch, "frames[0]", "expected the empty delimiter frame")
    seq = _decode_seq(seq_frame)
    if seq != END_SEQ:
        return ReplayFrame(seq, topic, bytes(payload), end=False)
    if payload:
        raise DecodeError(ErrorKind.bad_batch, "payload", "the replay end marker must have an empty payload")
    return ReplayFrame(seq, topic, None, end=True)


def encode_replay_request(start_seq: int) -> list[bytes]:
    """The frames a DEALER sends to ask an engine for every buffered batch with seq >= start_seq."""
    if not 0 <= start_seq <= U64_MASK:
        raise ValueError(f"start_seq {start_seq} is not a u64")
    return [b"", start_seq.to_bytes(8, "big")]


def decode_topic(frame: bytes) -> str:
    """The topic frame of a live message or replay reply; not UTF-8 is a bad_batch DecodeError."""
    try:
        return bytes(frame).decode("utf-8")
    except UnicodeDecodeError:
        raise DecodeError(ErrorKind.bad_batch, "topic", "topic frame is not UTF-8") from None


def live_seq(frames: Sequence[bytes]) -> int | None:
    """The seq of a live `[topic, seq, payload]` message, or None when there is none to read (a bad_batch).

    A message with a readable seq consumes it even when its topic or payload is bad, so that a
    malformed message is counted once where it stands and does not look like a gap to replay.
    """
    if len(frames) != 3 or len(frames[1]) != 8:
        return None
    return int.from_bytes(frames[1], "big")


def _decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise DecodeError(ErrorKind.bad_batch, "seq", f"expected 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def _batch_parts(raw: Any) -> tuple[float, list[Any], int]:
    """(ts, raw events, dp_rank) of a batch shaped [ts, events(, dp_rank)] or as a map."""
    if isinstance(raw, list):
        if len(raw) < 2:
            raise DecodeError(
                ErrorKind.bad_batch, "batch", f"expected [ts, events, dp_rank?], got {len(raw)} items"
            )
        ts, events, dp_rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        ts, events = _batch_field(raw, "ts"), _batch_field(raw, "events")
        dp_rank = next((raw[k] for k in ("data_parallel_rank", "dp_rank", "attn_dp_rank") if k in raw), None)
    else:
        raise DecodeError(ErrorKind.bad_batch, "batch", f"expected an array or a map, got {describe(raw)}")
    if type(ts) not in (int, float):
        raise DecodeError(ErrorKind.bad_batch, "ts", f"expected a number, got {describe(ts)}")
    if not isinstance(events, list):
        raise DecodeError(ErrorKind.bad_batch, "events", f"expected an array, got {describe(events)}")
    return float(ts), events, _decode_dp_rank(dp_rank)


def _batch_field(raw: Mapping[Any, Any], key: str) -> Any:
    if key not in raw:
        raise DecodeError(ErrorKind.bad_batch, key, "required batch field is absent")
    return raw[key]


def _decode_dp_rank(value: Any) -> int:
    """vLLM's data_parallel_rank / SGLang's attn_dp_rank; None (no data parallelism) is rank 0."""
    if value is None:
        return 0
    if type(value) is int and 0 <= value < _U32_LIMIT:
        return value
    raise DecodeError(ErrorKind.bad_batch, "dp_rank", f"expected a u32 or null, got {describe(value)}")


def _decode_event(raw: Any, default_block_size: int | None) -> EventData:
    tag, fields = _tagged_fields(raw)
    if tag == "BlockStored":
        return _decode_stored(fields, default_block_size)
    if tag == "BlockRemoved":
        return Removed(_hash_list(require(fields, "block_hashes")), tier_from_medium(fields.get("medium")))
    return Cleared()


def _tagged_fields(raw: Any) -> tuple[str, Mapping[Any, Any]]:
    """The tag and the named fields of a map-shaped or positional (array-shaped) event."""
    if isinstance(raw, dict):
        return _known_tag(require(raw, "type")), raw
    if isinstance(raw, list) and raw:
        tag = _known_tag(raw[0])
        return tag, dict(zip(_POSITIONAL_FIELDS[tag], raw[1:], strict=False))
    if isinstance(raw, list):
        raise DecodeError(ErrorKind.missing_field, "type", "empty event array has no tag")
    raise DecodeError(ErrorKind.bad_type, "event", f"expected a map or an array, got {describe(raw)}")


def _known_tag(tag: Any) -> str:
    if not isinstance(tag, str) or tag not in _POSITIONAL_FIELDS:
        raise DecodeError(ErrorKind.unknown_type, "type", f"unknown event type {describe(tag)}")
    return tag


def _decode_stored(fields: Mapping[Any, Any], default_block_size: int | None) -> Stored:
    block_hashes = _hash_list(require(fields, "block_hashes"))
    parent = fields.get("parent_block_hash")
    return Stored(
        parent_hash=None if parent is None else normalize_hash(parent, "parent_block_hash"),
        block_hashes=block_hashes,
        tokens_hashes=_tokens_hashes(fields, len(block_hashes), default_block_size),
        tier=tier_from_medium(fields.get("medium")),
    )


def _hash_list(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise DecodeError(ErrorKind.bad_hash, "block_hashes", f"expected an array, got {describe(value)}")
    try:
        array("Q", value)  # the common case, checked in C: every hash already an int in [0, 2^64)
    except (OverflowError, TypeError):
        return [normalize_hash(h, "block_hashes") for h in value]
    if True in value or False in value:  # bools pass the array check (and compare equal to 1/0)
        return [normalize_hash(h, "block_hashes") for h in value]
    return value


def _tokens_hashes(fields: Mapping[Any, Any], n_blocks: int, default_block_size: int | None) -> list[int]:
    """Local hashes of the event's first `n_blocks` full blocks of token ids."""
    block_size = _block_size(fields.get("block_size"), default_block_size)
    return _local_hashes(require(fields, "token_ids"), n_blocks, block_size, fields.get("lora_name"))


def _local_hashes(tokens: Any, n_blocks: int, block_size: int, lora_name: Any) -> list[int]:
    if not isinstance(tokens, list):
        raise DecodeError(ErrorKind.bad_tokens, "token_ids", f"expected an array, got {describe(tokens)}")
    needed = n_blocks * block_size
    if len(tokens) < needed:
        raise DecodeError(
            ErrorKind.bad_tokens,
            "token_ids",
            f"{len(tokens)} token ids do not fill {counted(n_blocks, 'block')} of {block_size}",
        )
    if lora_name is not None and not isinstance(lora_name, str):
        raise DecodeError(ErrorKind.bad_type, "lora_name", f"expected a string, got {describe(lora_name)}")
    try:
        return local_block_hashes(tokens if len(tokens) == needed else tokens[:needed], block_size,
                                  lora_name=lora_name)
    except (ValueError, TypeError) as exc:  # an id outside u32, or not an int at all
        raise DecodeError(ErrorKind.bad_tokens, "token_ids", str(exc)) from None


def _removed_hashes(raw: msgspec.Raw, packed: bool) -> Sequence[int]:
    """A removal's block hashes from their msgpack as it is. Anything but ints in [0, 2^64) (the walk also
    takes negative ints, bit-cast, and bytes digests) gives the batch up to the walk, as `_packed_local_hashes`
    does."""
    hashes = array("Q")
    try:
        hashes.frombytes(native.u64_from_msgpack(raw))
    except ValueError:
        raise DecodeError(ErrorKind.bad_hash, "block_hashes", "") from None
    return hashes if packed else hashes.tolist()


def _packed_local_hashes(raw: msgspec.Raw, n_blocks: int, block_size: int, lora_name: Any,
                         packed: bool) -> Sequence[int]:
    """`_local_hashes` of the typed pass, from the token ids' msgpack as it is (with `packed`, as the
    array('Q') they are computed in). Anything `_local_hashes` would refuse (and a bool it would take as an
    int) raises a DecodeError without detail: the typed pass then gives the batch up, and the general walk
    decodes it and words the error."""
    try:
        tokens = native.u32le_from_msgpack(raw)
    except ValueError:
        raise DecodeError(ErrorKind.bad_tokens, "token_ids", "") from None
    needed = 4 * n_blocks * block_size
    if len(tokens) < needed or (lora_name is not None and not isinstance(lora_name, str)):
        raise DecodeError(ErrorKind.bad_tokens, "token_ids", "")
    with memoryview(tokens) as view:
        hashes = block_hashes_of_packed(view[:needed], block_size, lora_name=lora_name)
    return hashes if packed else hashes.tolist()


def _block_size(value: Any, default_block_size: int | None) -> int:
    if value is None:
        value = default_block_size
        if value is None:
            raise DecodeError(
                ErrorKind.missing_field, "block_size", "absent, and no default block size given"
            )
    if type(value) is not int or not 0 < value < _U32_LIMIT:  # Dynamo's block sizes are u32
        raise DecodeError(ErrorKind.bad_block_size, "block_size", f"not a positive u32: {describe(value)}")
    return value
