"""The pure-Python twin of `_native.c`, for an install without a C compiler: the same functions, the same
results, the same exceptions and messages (tests/core/test_native_twins.py holds them to it).

Each takes the fast road through `msgspec`, `array` and the `xxhash` package, so no loop runs per byte or per
token in Python; where that road refuses an input, a slower one finds the refusal the C code would give.
"""

from __future__ import annotations

import re
import struct
import sys
from array import array
from collections import Counter
from collections.abc import Iterable
from datetime import datetime
from itertools import repeat
from typing import TYPE_CHECKING, Any

import msgspec
from xxhash import xxh3_64_intdigest

if TYPE_CHECKING:  # collections.abc.Buffer from Python 3.12 on
    from typing_extensions import Buffer

_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1
_INT_LIST = msgspec.json.Decoder(list[int])
_INT_LIST_MSGPACK = msgspec.msgpack.Decoder(list[int])
_PAIRS_MSGPACK = msgspec.msgpack.Decoder(list[tuple[int, int]])

# JSON whitespace (exactly the C reader's is_ws: not \v or \f, which `\s` would take).
_WS = re.compile(rb"[ \t\n\r]*")
_DIGITS = re.compile(rb"[0-9]*")
_JSON_TYPES = {ord('"'): "str", ord("["): "array", ord("{"): "object", ord("t"): "bool", ord("f"): "bool",
               ord("n"): "null"}
_HEAD = re.compile(rb'[ \t\n\r]*\{[ \t\n\r]*"token_ids"[ \t\n\r]*:[ \t\n\r]*\[')
_AFTER_HEAD = re.compile(rb'[ \t\n\r]*(?:,[ \t\n\r]*(?=")|(?=\}))')


def _bytes_of(data: Buffer) -> memoryview:
    """`data`'s bytes, as the C code's PyBUF_SIMPLE view sees them, with its errors for what has none."""
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(f"a bytes-like object is required, not '{type(data).__name__}'") from None
    if not view.c_contiguous:
        raise BufferError("memoryview: underlying buffer is not C-contiguous")
    return view.cast("B")


def _u32s(raw: Buffer) -> bytes | None:
    """A JSON array of u32s as native u32 bytes, the fast way; None where the careful reader must look."""
    packed = array("I")
    try:
        packed.fromlist(_INT_LIST.decode(raw))  # fromlist walks a list a third faster than the constructor
    except (msgspec.DecodeError, OverflowError):
        return None
    return packed.tobytes()


def _malformed(at: int) -> ValueError:
    return ValueError(f"JSON is malformed at byte {at} of `$.token_ids`")


def _end(run: re.Pattern[bytes], s: bytes, i: int) -> int:
    """Where the run of `run`'s characters at `i` ends: it matches the empty string too, so it always matches."""
    found = run.match(s, i)
    assert found is not None
    return found.end()


def _refusal(s: bytes) -> ValueError:
    """The error the C reader gives for `s`, which it does not read as an array of u32s: its checks in its
    order, element by element (a number at a time, not a byte)."""
    n = len(s)
    i = _end(_WS, s, 0)
    if i == n:
        return _malformed(i)
    if s[i] != ord("["):
        kind = _JSON_TYPES.get(s[i]) or ("number" if s[i] in b"0123456789-" else None)
        return _malformed(i) if kind is None else ValueError(f"Expected `array`, got `{kind}` - at `$.token_ids`")
    i = _end(_WS, s, i + 1)
    if i < n and s[i] == ord("]"):
        i = _end(_WS, s, i + 1)
        return _malformed(i)  # `[]` and then something more
    count = 0
    while True:
        i = _end(_WS, s, i)
        if i == n:
            return _malformed(i)
        start = i
        negative = s[i] == ord("-")
        i += negative
        if i == n or not 0x30 <= s[i] <= 0x39:
            kind = None if negative else _JSON_TYPES.get(s[start])
            if kind is None:
                return _malformed(start)
            return ValueError(f"Expected `int`, got `{kind}` - at `$.token_ids[{count}]`")
        end = i + 1 if s[i] == ord("0") else _end(_DIGITS, s, i)
        value = int(s[i:end])
        i = end
        fractional = False
        if i < n and s[i] == ord("."):
            i += 1
            if i == n or not 0x30 <= s[i] <= 0x39:
                return _malformed(i)
            i = _end(_DIGITS, s, i)
            fractional = True
        if i < n and s[i] in b"eE":
            i += 1
            if i < n and s[i] in b"+-":
                i += 1
            if i == n or not 0x30 <= s[i] <= 0x39:
                return _malformed(i)
            i = _end(_DIGITS, s, i)
            fractional = True
        if i < n and 0x30 <= s[i] <= 0x39:  # a leading zero: 01
            return _malformed(i)
        if fractional:
            return ValueError(f"Expected `int`, got `float` - at `$.token_ids[{count}]`")
        if negative and value != 0:
            return ValueError(f"Expected `int` >= 0 - at `$.token_ids[{count}]`")
        if value > _U32_MAX:
            return ValueError(f"Expected `int` <= {_U32_MAX} - at `$.token_ids[{count}]`")
        count += 1
        i = _end(_WS, s, i)
        if i == n:
            return _malformed(i)
        if s[i] == ord("]"):
            return _malformed(_end(_WS, s, i + 1))  # the array is sound: what follows it is not
        if s[i] != ord(","):
            return _malformed(i)
        i += 1


def u32_from_json(raw: Buffer) -> bytes:
    """A JSON array of integers in [0, 2^32) as native-endian u32 bytes; ValueError, worded like msgspec's, for
    anything else."""
    view = _bytes_of(raw)
    packed = _u32s(view)
    if packed is None:
        raise _refusal(bytes(view))
    return packed


def u32_head_of_object(raw: Buffer) -> tuple[bytes, int] | None:
    """For an object that opens with a sound `"token_ids"` array of u32s: those (as u32_from_json gives them) and
    the offset of what follows the array and its comma (the next member's quote, or the closing brace). None for
    anything else."""
    s = bytes(_bytes_of(raw))
    head = _HEAD.match(s)
    if head is None:
        return None
    close = s.find(b"]", head.end())  # an array of numbers holds no other ']'
    if close < 0:
        return None
    packed = _u32s(s[head.end() - 1 : close + 1])
    after = _AFTER_HEAD.match(s, close + 1)
    if packed is None or after is None:
        return None
    return packed, after.end()


def _u64(value: Any) -> int:
    """`value` as PyLong_AsUnsignedLongLong takes it: an int in [0, 2^64), with CPython's own errors."""
    if not isinstance(value, int):
        raise TypeError("an integer is required")
    if value < 0:
        raise OverflowError("can't convert negative int to unsigned")
    if value > _U64_MAX:
        raise OverflowError("int too big to convert")
    return value


def _ssize(value: Any) -> int:
    """`value` as PyLong_AsSsize_t takes it, with CPython's own errors."""
    if not isinstance(value, int):
        raise TypeError("an integer is required")
    if value > sys.maxsize or value < -sys.maxsize - 1:
        raise OverflowError("Python int too large to convert to C ssize_t")
    return value


def xxh3_blocks(data: Buffer, stride: int, seed: int, *window: int) -> bytes:
    """XXH3-64 (seeded) of the `window` bytes (default: `stride`) at each multiple of `stride` that has them whole,
    as native-endian u64s; a window wider than the stride overlaps the next block (EAGLE's)."""
    if len(window) > 1:
        raise TypeError("xxh3_blocks(data, stride, seed, window=stride) takes 3 or 4 arguments")
    stride = _ssize(stride)
    if stride <= 0:
        raise ValueError("stride must be positive")
    seed = _u64(seed)
    width = _ssize(window[0]) if window else stride
    if width < stride:
        raise ValueError("window must be at least stride")
    with _bytes_of(data) as view:
        whole = view.tobytes()  # slices of bytes hash faster than slices of a memoryview
    starts = range(0, len(whole) - width + 1, stride)
    return array("Q", [xxh3_64_intdigest(whole[at : at + width], seed) for at in starts]).tobytes()


_PAIR = struct.Struct("<QQ")


def xxh3_chain(hashes: Iterable[int], seed: int) -> list[int]:
    """Dynamo's sequence hashes: the first is the first local hash, then XXH3-64(le64(previous) || le64(local),
    seed)."""
    seed = _u64(seed)
    try:
        local = list(hashes)
    except TypeError:
        raise TypeError("xxh3_chain needs a sequence of u64 hashes") from None
    try:
        array("Q", local)  # every hash in u64, checked at once
    except (OverflowError, TypeError):
        for value in local:
            _u64(value)  # the first that is not, with the C code's error
        raise  # pragma: no cover - array and _u64 refuse the same values
    if not local:
        return []
    previous = int(local[0])  # an int, as C's PyLong_FromUnsignedLongLong gives, not a bool
    out = [previous]
    append, pack = out.append, _PAIR.pack
    for value in local[1:]:
        previous = xxh3_64_intdigest(pack(previous, value), seed)
        append(previous)
    return out


def bind_run(lookup: dict[Any, Any], keys: Iterable[Any], value: Any, replaceable: Any) -> int:
    """Binds keys to `value` in order, where a key is unbound, bound to `value` or to `replaceable` (not None);
    stops at the first bound to anything else. Returns how many keys it went past (len(keys) when all)."""
    if type(lookup) is not dict:
        raise TypeError("bind_run needs a dict")
    try:
        run = list(keys)
    except TypeError:
        raise TypeError("bind_run needs a sequence of keys") from None
    for n, key in enumerate(run):
        held = lookup.setdefault(key, value)
        if held is not value:
            if replaceable is None or held is not replaceable:
                return n
            lookup[key] = value
    return len(run)


_MAP_KEYS = "U64Map keys: a buffer of u64s (format 'Q'), or a sequence of ints"
_ABSENT = object()


def _map_key(key: Any) -> int:
    """A key about to be stored, checked as the C map checks it."""
    if not isinstance(key, int):
        raise TypeError(f"U64Map keys are ints in [0, 2^64), not {type(key).__name__}")
    return _u64(key)


def _map_keys(keys: Any) -> list[int]:
    try:
        view = memoryview(keys)
    except TypeError:
        try:
            run = list(keys)
        except TypeError:
            raise TypeError(_MAP_KEYS) from None
        return [_map_key(k) for k in run]
    if view.itemsize != 8 or view.format not in ("Q", "L") or not view.c_contiguous:
        raise TypeError(_MAP_KEYS)
    return view.tolist()


class U64Map(dict[int, Any]):
    """`_native.U64Map`'s twin: a dict whose stored keys are checked as the C map's are, with its bulk methods."""

    __slots__ = ()

    def __setitem__(self, key: int, value: Any) -> None:
        dict.__setitem__(self, _map_key(key), value)

    def popitem(self) -> tuple[int, Any]:
        if not self:
            raise KeyError("popitem(): the map is empty")
        return dict.popitem(self)

    def items(self) -> list[tuple[int, Any]]:  # type: ignore[override]
        return list(dict.items(self))

    def bind_run(self, keys: Any, value: Any, replaceable: Any) -> int:
        """Binds keys to `value` in order, where a key is unbound, bound to `value` or to `replaceable` (not None);
        stops at the first bound to anything else. Returns how many keys it went past (len(keys) when all)."""
        run = _map_keys(keys)
        for n, key in enumerate(run):
            held = self.setdefault(key, value)
            if held is not value:
                if replaceable is None or held is not replaceable:
                    return n
                dict.__setitem__(self, key, value)
        return len(run)

    def repoint(self, keys: Any, old: Any, new: Any) -> int:
        """The keys bound to `old` (by identity) bound to `new` instead, or taken out where `new` is None; returns
        how many were."""
        changed = 0
        for key in _map_keys(keys):
            if dict.get(self, key, _ABSENT) is old:
                changed += 1
                if new is None:
                    del self[key]
                else:
                    dict.__setitem__(self, key, new)
        return changed

    def fill(self, keys: Any, value: Any) -> None:
        """Every key bound to `value`, as dict.update with the pairs would."""
        dict.update(self, zip(_map_keys(keys), repeat(value)))


def u64_counts(data: Buffer) -> bytes:
    """How many times each native-endian u64 of `data` occurs: (value, count) u64 pairs, in the order each value
    first occurs; ValueError for a length that is not a multiple of 8."""
    view = _bytes_of(data)
    if len(view) % 8:
        raise ValueError("not a whole number of u64s")
    pairs = array("Q")
    for value, count in Counter(view.cast("Q")).items():
        pairs.extend((value, count))
    return pairs.tobytes()


def u64s_distinct(packed: Buffer) -> bool:
    """Whether no native-endian u64 of `packed` repeats; ValueError for a length that is not a multiple of 8."""
    view = _bytes_of(packed)
    if len(view) % 8:
        raise ValueError("not a whole number of u64s")
    hashes = view.cast("Q")
    return len(set(hashes)) == len(hashes)


def by_sequence(children: dict[int, Any], previous: int, seed: int) -> U64Map:
    """The values of `children` (keyed by u64 local hashes) keyed by the sequence hash each key's block chains to
    from sequence hash `previous`: XXH3-64(le64(previous) || le64(key), seed)."""
    if not isinstance(children, dict):
        raise TypeError("by_sequence needs a dict keyed by u64 local hashes")
    previous, seed = _u64(previous), _u64(seed)
    out = U64Map()
    for key, value in children.items():
        out[xxh3_64_intdigest(_PAIR.pack(previous, _u64(key)), seed)] = value
    return out


def solo_split(children: Iterable[Any], allowed: int, above: int) -> tuple[bytes, list[Any], int]:
    """Of radix tree nodes `above` blocks deep, those one worker of `allowed` holds whole and no other in part, and
    all below them that worker holds, as runs ((blocks above) << 32 | blocks held, native-endian u64s); the other
    nodes, in order; and the nodes counted."""
    above = _u64(above)
    runs = array("Q")
    rest = []
    visited = 0
    for node in list(children):
        mask = node.full & allowed
        if not mask or mask & (mask - 1) or node.cutoffs:
            rest.append(node)
            continue
        slot = mask.bit_length() - 1
        stack = [(above, [node])]
        while stack:
            depth, batch = stack.pop()
            for below in batch:
                visited += 1
                length = len(below.packed)
                whole = bool(below.full & mask)
                held = length if whole else (below.cutoffs or {}).get(slot, 0)
                if held <= 0:
                    continue
                runs.append(depth << 32 | held)
                if whole and below.children:
                    stack.append((depth + length, list(below.children.values())))
    return runs.tobytes(), rest, visited


# ----- engine_batch_msgpack -------------------------------------------------------------------------------------

ENGINE_FIELDS = ("block_hashes", "token_ids", "parent_block_hash", "block_size", "lora_name", "medium", "lora_id",
                 "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality",
                 "ownership", "session_id", "cache_salt", "lookahead_token_ids")
"""The fields of an event of `engine_batch_msgpack`, in the order of its tuple."""
_ENGINE_REFUSAL = "not an engine batch the typed pass reads"
_MAX_DEPTH = 32


class _Stored(msgspec.Struct, tag_field="type", tag="BlockStored", forbid_unknown_fields=True):
    block_hashes: msgspec.Raw
    token_ids: msgspec.Raw
    parent_block_hash: int | None = None
    block_size: Any = None
    lora_name: Any = None
    medium: Any = None
    lora_id: Any = None
    extra_keys: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    group_idx: Any = None
    kv_cache_spec_kind: Any = None
    kv_cache_spec_sliding_window: Any = None
    locality: Any = None
    ownership: Any = None
    session_id: Any = None
    cache_salt: Any = None
    lookahead_token_ids: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


class _Removed(msgspec.Struct, tag_field="type", tag="BlockRemoved", forbid_unknown_fields=True):
    block_hashes: msgspec.Raw
    medium: Any = None
    group_idx: Any = None
    kv_cache_spec_kind: Any = None
    locality: Any = None
    ownership: Any = None


class _Cleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", forbid_unknown_fields=True):
    group_idx: Any = None
    locality: Any = None
    ownership: Any = None


class _Batch(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    ts: int | float
    events: list[_Stored | _Removed | _Cleared]
    dp_rank: int | None = None


_BATCH = msgspec.msgpack.Decoder(_Batch)


def engine_batch_msgpack(payload: Buffer) -> tuple[int | float, int | None, list[tuple[int, tuple[Any, ...]]]]:
    """An engine's KV event batch `[ts, events, dp_rank?]` as the typed decoding pass reads it: each event as
    (kind: 0 stored, 1 removed, 2 cleared, its `ENGINE_FIELDS` in order, None where absent), block hashes as
    native-endian u64 bytes (signed ones mod 2^64), token ids as (little-endian u32 bytes, whether they came as
    EAGLE pairs), `extra_keys` as its msgpack, the rest as msgspec decodes a field typed Any. ValueError for
    anything else: an unknown field or tag, a value of the wrong type, an ext or a map keyed by an array in a
    field decoded, nesting deeper than 32, bad UTF-8, trailing bytes."""
    try:
        batch = _BATCH.decode(_bytes_of(payload))
        if batch.dp_rank is not None and not 0 <= batch.dp_rank <= _U32_MAX:
            raise ValueError(_ENGINE_REFUSAL)
        events = [_engine_event(event) for event in batch.events]
    except (msgspec.DecodeError, RecursionError, ValueError):
        raise ValueError(_ENGINE_REFUSAL) from None
    return batch.ts, batch.dp_rank, events


def _engine_event(event: _Stored | _Removed | _Cleared) -> tuple[int, tuple[Any, ...]]:
    fields = dict.fromkeys(ENGINE_FIELDS)
    for name in event.__struct_fields__:
        value = getattr(event, name)
        if name == "block_hashes":
            value = _hashes(value)
        elif name == "token_ids":
            value = _tokens(value)
        elif name == "extra_keys":
            value = None if value is msgspec.UNSET else bytes(value)
        elif name == "lookahead_token_ids":  # checked as the general walk's decode checks it, and not kept
            if value is not msgspec.UNSET and not _ids_only(msgspec.msgpack.decode(value), 1):
                raise ValueError(_ENGINE_REFUSAL)
            value = None
        elif not _sound(value, 1):
            raise ValueError(_ENGINE_REFUSAL)
        fields[name] = value
    kind = 0 if type(event) is _Stored else 1 if type(event) is _Removed else 2
    return kind, tuple(fields.values())


def _hashes(raw: msgspec.Raw) -> bytes:
    return array("Q", [h & _U64_MAX for h in _INT_LIST_MSGPACK.decode(raw)]).tobytes()


def _tokens(raw: msgspec.Raw) -> tuple[bytes, bool]:
    try:
        return _uints_from_msgpack(raw, "I"), False
    except ValueError:
        return _pairs_from_msgpack(raw), True


def _uints_from_msgpack(raw: Buffer, typecode: str) -> bytes:
    """A msgpack array of ints straight into packed unsigned ints ('I': little-endian u32s; 'Q': native u64s).
    msgspec takes exactly the encodings the C reader takes (any int encoding, no bool, float or trailing byte),
    and `array` refuses a negative or too large value."""
    try:
        packed = array(typecode, _INT_LIST_MSGPACK.decode(raw))
    except (msgspec.DecodeError, OverflowError):
        raise ValueError(_ENGINE_REFUSAL) from None
    if typecode == "I" and sys.byteorder == "big":  # pragma: no cover - exercised only on big-endian hosts
        packed.byteswap()
    return packed.tobytes()


def _pairs_from_msgpack(raw: Buffer) -> bytes:
    """A msgpack array of [a, b] pairs of ints in [0, 2^32) as little-endian u32 bytes: each a, then the last b;
    ValueError for anything else (an empty array included)."""
    try:
        pairs = _PAIRS_MSGPACK.decode(raw)
        if not pairs:
            raise ValueError(_ENGINE_REFUSAL)
        packed = array("I", [first for first, _ in pairs])
        packed.append(pairs[-1][1])
    except (msgspec.DecodeError, OverflowError):
        raise ValueError(_ENGINE_REFUSAL) from None
    if sys.byteorder == "big":  # pragma: no cover - exercised only on big-endian hosts
        packed.byteswap()
    return packed.tobytes()


def _sound(value: Any, depth: int) -> bool:
    """Whether a field's value is one the C reader builds: no ext, no map keyed by an array, 32 levels at most."""
    if depth > _MAX_DEPTH or isinstance(value, (msgspec.msgpack.Ext, datetime)):
        return False
    if isinstance(value, list):
        return all(_sound(item, depth + 1) for item in value)
    if isinstance(value, dict):
        return all(not isinstance(k, tuple) and _sound(k, depth + 1) and _sound(v, depth + 1)
                   for k, v in value.items())
    return True


def _ids_only(value: Any, depth: int) -> bool:
    """Whether a value the C reader only checks (lookahead_token_ids) is one it takes: arrays and scalars, 32 levels
    at most."""
    if depth > _MAX_DEPTH or isinstance(value, (msgspec.msgpack.Ext, datetime, dict)):
        return False
    return not isinstance(value, list) or all(_ids_only(item, depth + 1) for item in value)
