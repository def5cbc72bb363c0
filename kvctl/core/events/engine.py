"""Engine KV events as vLLM and SGLang publish them on ZMQ (docs/contract.md), decoded into kvctl's model.

Three generations of the same events reach a router: vLLM ≤ 0.23 sends positional tagged arrays,
vLLM ≥ 0.24 and SGLang send tagged maps, and hashes arrive as u64, signed i64 (SGLang) or raw
digest bytes (vLLM with int hashes off). All of them decode through one walk over the untyped
msgpack value, so a new engine field never breaks decoding and a bad event costs only itself:
it is reported in `EngineBatch.errors` and the rest of its batch still applies. The shape nearly
every batch has is first tried with a typed pass that gives the same answer faster, or gives up.

Each `Stored` gets its `tokens_hashes` from the event's own token ids (Dynamo's local hash, with the LoRA
name and the cache salt folded into the seed as Dynamo does); the engine's block hash stays an opaque id.
What else an event says (locality, ownership, medium, KV cache group, salt, EAGLE pairs) is read as Dynamo
1.6.1 reads it (`engine_fields`); an event it would not index is counted in `EngineBatch.filtered`, not
refused. Multimodal `extra_keys` are ignored for the local hash, as Dynamo 1.6.1's indexer does.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvctl.core import native
from kvctl.core.events.engine_fields import (
    MEDIUM_TIERS,
    SALT_PREFIX,
    Dropped,
    cache_salt_of,
    eagle_tokens,
    group_of,
    residency_drop,
    tier_of_medium,
)
from kvctl.core.events.errors import DecodeError, ErrorKind, describe, parse_msgpack, require
from kvctl.core.events.types import Cleared, EventData, Group, Rehash, Removed, Stored
from kvctl.core.hashing import U64_MASK, XXH3_SEED, block_hashes_of_packed, block_seed, eagle_block_hashes, pack_tokens

END_SEQ = U64_MASK
"""The seq of the replay end marker (vLLM's END_SEQ = -1 as 8 unsigned big-endian bytes)."""

_I64_MIN = -(1 << 63)
_U32_LIMIT = 1 << 32
_CLEARED = Cleared()


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
    dp_rank: int | None  # None when the batch names none: its stream's registered rank, as Dynamo takes it
    events: list[EventData]
    errors: list[DecodeError]
    filtered: list[str] = msgspec.field(default_factory=list)
    """The `Dropped` cause of each event that decoded but is not indexed (as Dynamo 1.6.1 drops it)."""


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
                        packed: bool = False, keep_tokens: bool = False) -> EngineBatch:
    """Decode a batch payload; raises DecodeError only when the batch itself is unusable.

    `default_block_size` is the model's: a store that names another indexes no block, as in Dynamo, and one
    that names none is read with it. With `packed`, every event's hashes come as an array('Q') (the router's
    decode process sends them packed, and reads them so from the common shape without an int per block). With
    `keep_tokens`, unsalted stores with a parent keep their token ids (`Stored.rehash`), so that the stream can
    hash them under a salted parent's salt.
    """
    batch = _decode_common(payload, default_block_size, packed, keep_tokens)
    return _decode_any(payload, default_block_size, keep_tokens) if batch is None else batch


_SALT_TAG = SALT_PREFIX.encode()
_STORED, _REMOVED = 0, 1  # the kinds of `native.engine_batch_msgpack`'s events (2: cleared)


def _decode_common(payload: bytes, default_block_size: int | None, packed: bool = False,
                   keep_tokens: bool = False) -> EngineBatch | None:
    """The shape nearly every batch has (vLLM >= 0.24 and SGLang: `[ts, events, dp_rank]` of map events with the
    fields vLLM 0.34 and SGLang 0.5.23 send, every event sound), read in one C pass (`native.engine_batch_msgpack`:
    token ids and hashes packed as they are read, never an int per element) instead of a walk over untyped values
    (a 20-block store: 7-8 us here, where msgspec with the ids left raw and read again took 9-11 us, and an EAGLE
    store's pairs 1.4x that). None for anything else, which `_decode_any` then decodes and reports; both passes
    build their events with the same helpers, so they agree on every payload this one accepts (a property test
    holds them to it)."""
    try:
        ts, dp_rank, raw_events = native.engine_batch_msgpack(payload)
    except ValueError:
        return None  # not the common shape: the general walk says why
    events: list[EventData] = []
    filtered: list[str] = []
    try:
        for kind, (hashes, tokens, parent, block_size, lora_name, medium, _lora_id, extra_keys, group_idx, spec_kind,
                   window, locality, ownership, _session_id, cache_salt, _lookahead) in raw_events:
            decoded: EventData | Dropped
            if kind == _STORED:
                decoded = _stored(locality, ownership, medium, parent, _hashes(hashes, packed), tokens, block_size,
                                  default_block_size, lora_name, cache_salt,
                                  None if extra_keys is None else _salt_keys(extra_keys),
                                  None if group_idx is None and spec_kind is None else
                                  group_of(group_idx, spec_kind, window, block_size), packed, keep_tokens)
            elif kind == _REMOVED:
                decoded = _removed(locality, ownership, medium, _hashes(hashes, packed), group_of(group_idx, spec_kind))
            else:
                drop = residency_drop(locality, ownership)
                decoded = _CLEARED if drop is None else drop
            if isinstance(decoded, Dropped):
                filtered.append(decoded.value)
            else:
                events.append(decoded)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError, DecodeError):
        return None  # not sound: the general walk says why
    return EngineBatch(float(ts), dp_rank, events, [], filtered)


def _decode_any(payload: bytes, default_block_size: int | None, keep_tokens: bool = False) -> EngineBatch:
    """Every shape a batch may have, each event decoded (or reported) on its own."""
    ts, raw_events, dp_rank = _batch_parts(parse_msgpack(payload))
    events: list[EventData] = []
    errors: list[DecodeError] = []
    filtered: list[str] = []
    for index, raw in enumerate(raw_events):
        try:
            event = _decode_event(raw, default_block_size, keep_tokens)
        except DecodeError as exc:
            errors.append(DecodeError(exc.kind, exc.field, exc.detail, index))
            continue
        if isinstance(event, Dropped):
            filtered.append(event.value)
        else:
            events.append(event)
    return EngineBatch(ts, dp_rank, events, errors, filtered)


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


def _batch_parts(raw: Any) -> tuple[float, list[Any], int | None]:
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


def _decode_dp_rank(value: Any) -> int | None:
    """vLLM's data_parallel_rank / SGLang's attn_dp_rank; None stays None (the stream's own rank)."""
    if value is None:
        return None
    if type(value) is int and 0 <= value < _U32_LIMIT:
        return value
    raise DecodeError(ErrorKind.bad_batch, "dp_rank", f"expected a u32 or null, got {describe(value)}")


def _decode_event(raw: Any, default_block_size: int | None, keep_tokens: bool) -> EventData | Dropped:
    tag, fields = _tagged_fields(raw)
    get = fields.get
    if tag == "BlockStored":
        block_hashes = _hash_list(require(fields, "block_hashes"))
        parent = get("parent_block_hash")
        return _stored(get("locality"), get("ownership"), get("medium"),
                       None if parent is None else normalize_hash(parent, "parent_block_hash"), block_hashes,
                       _tokens_of_list(require(fields, "token_ids")), get("block_size"), default_block_size,
                       get("lora_name"), get("cache_salt"), get("extra_keys"),
                       group_of(get("group_idx"), get("kv_cache_spec_kind"), get("kv_cache_spec_sliding_window"),
                                get("block_size")), False, keep_tokens)
    if tag == "BlockRemoved":
        return _removed(get("locality"), get("ownership"), get("medium"), _hash_list(require(fields, "block_hashes")),
                        group_of(get("group_idx"), get("kv_cache_spec_kind")))
    drop = residency_drop(get("locality"), get("ownership"))
    return _CLEARED if drop is None else drop


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


def _stored(locality: Any, ownership: Any, medium: Any, parent: int | None, hashes: Sequence[int],
            tokens: tuple[bytes, bool], block_size: Any, default_block_size: int | None, lora_name: Any,
            cache_salt: Any, extra_keys: Any, group: Group | None, packed: bool, keep_tokens: bool = False
            ) -> Stored | Dropped:
    """A store as Dynamo 1.6.1 converts it, or why it drops it. `tokens`: the token ids as u32 LE, and whether
    they came as EAGLE pairs. Block i is hashed from token window i from the start; the blocks that have no
    full window, all of them when the store's block size is not the model's, and all of them when a hash
    repeats, are cut and counted (`Stored.cut`), as Dynamo drops them. With `keep_tokens`, an unsalted store
    with a parent keeps what it was hashed from (`Stored.rehash`), to inherit its parent's salt."""
    # The common case first, inline (this runs for every store): nothing on locality, ownership, salt or group.
    drop = None if locality is None and ownership is None else residency_drop(locality, ownership)
    tier = MEDIUM_TIERS.get(medium) if type(medium) is str else tier_of_medium(medium)
    if drop is not None or tier is None:
        return Dropped.unknown_medium if drop is None else drop
    if lora_name is not None and not isinstance(lora_name, str):
        raise DecodeError(ErrorKind.bad_type, "lora_name", f"expected a string, got {describe(lora_name)}")
    if type(hashes) is not array and hashes and min(hashes) < 0:
        hashes = [h & U64_MASK for h in hashes]
    packed_hashes = hashes if type(hashes) is array else array("Q", hashes)
    if packed:
        hashes = packed_hashes
    if parent is not None:
        parent &= U64_MASK
    salt = None if cache_salt is None and extra_keys is None else cache_salt_of(cache_salt, extra_keys, lora_name)
    size = block_size if type(block_size) is int and block_size == default_block_size else \
        _block_size(block_size, default_block_size)
    n = len(hashes)
    cut = Dropped.block_size_mismatch if default_block_size is not None and size != default_block_size else \
        Dropped.self_reference if not native.u64s_distinct(packed_hashes) or parent in packed_hashes else None
    if cut is not None:
        return Stored(parent, array("Q") if packed else [], array("Q") if packed else [], tier, group, salt, cut.value,
                      n)
    packed_tokens, eagle = tokens
    extra = 4 if eagle else 0
    kept = min(n, max(0, len(packed_tokens) - extra) // (4 * size))
    seed = XXH3_SEED if lora_name is None and salt is None else block_seed(lora_name, salt)
    window = packed_tokens[:4 * kept * size + extra]
    local = eagle_block_hashes(window, size, seed) if eagle else block_hashes_of_packed(window, size, seed)
    rehash = Rehash(window, size, lora_name or None, eagle) if keep_tokens and salt is None and parent is not None \
        else None
    if kept < n:
        return Stored(parent, hashes[:kept], local if packed else local.tolist(), tier, group, salt,
                      Dropped.short_tokens.value, n - kept, rehash)
    return Stored(parent, hashes, local if packed else local.tolist(), tier, group, salt, rehash=rehash)


def _removed(locality: Any, ownership: Any, medium: Any, hashes: Sequence[int], group: Group | None
             ) -> Removed | Dropped:
    drop = None if locality is None and ownership is None else residency_drop(locality, ownership)
    tier = MEDIUM_TIERS.get(medium) if type(medium) is str else tier_of_medium(medium)
    if drop is not None or tier is None:
        return Dropped.unknown_medium if drop is None else drop
    return Removed(hashes, tier, group)


def _tokens_of_list(value: Any) -> tuple[bytes, bool]:
    """The walk's token ids (a list of ints, or of EAGLE pairs) as u32 LE, and whether they were pairs."""
    if not isinstance(value, list):
        raise DecodeError(ErrorKind.bad_tokens, "token_ids", f"expected an array, got {describe(value)}")
    tokens = eagle_tokens(value)
    try:
        return pack_tokens(value if tokens is None else tokens).tobytes(), tokens is not None
    except (ValueError, TypeError) as exc:  # an id outside u32, or not an int at all
        raise DecodeError(ErrorKind.bad_tokens, "token_ids", str(exc)) from None


_KNOWN_KEYS: dict[bytes, Any] = {}
"""`extra_keys` payloads known to decode, with what `cache_salt_of` reads of them (the first block's keys where a
salt is tagged, else None): a fleet's stores repeat a few (one per adapter, salt and length)."""
_KNOWN_KEYS_MAX = 1024
_KNOWN_KEY_BYTES = 4096
_KNOWN_FIRST_KEYS = 8
"""Larger payloads, and first blocks of more keys, are decoded each time, not kept: the cache holds ~5 MiB at most,
whatever an engine sends."""
_UNKNOWN = object()


def _salt_keys(raw: bytes) -> Any:
    """A store's `extra_keys` where they may tag a cache salt (of a list, the first block's keys: all
    `cache_salt_of` reads), else None: vLLM sends one list per block (a LoRA store names its adapter in each), and
    building them all costs more than the rest of a store. Each distinct payload is decoded once: an invalid
    string in them refuses the batch, as the walk does."""
    known = _KNOWN_KEYS.get(raw, _UNKNOWN)
    if known is not _UNKNOWN:
        return known
    keys = msgspec.msgpack.decode(raw)
    tagged = (keys[:1] if isinstance(keys, list) else keys) if _SALT_TAG in raw else None
    first = tagged[0] if isinstance(tagged, list) and tagged else None
    if len(raw) <= _KNOWN_KEY_BYTES and not (isinstance(first, list) and len(first) > _KNOWN_FIRST_KEYS):
        if len(_KNOWN_KEYS) >= _KNOWN_KEYS_MAX:
            _KNOWN_KEYS.clear()
        _KNOWN_KEYS[raw] = tagged
    return tagged


def _hashes(packed_hashes: bytes, packed: bool) -> Sequence[int]:
    """An event's block hashes, as the C reader packed them: kept packed, or as a list of ints."""
    hashes = array("Q")
    hashes.frombytes(packed_hashes)
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
