"""The one-pass reader of an engine's batch (`engine_batch_msgpack`: C, and the pure-Python twin): block hashes and
token ids over every msgpack int encoding and array header (engines' encoders differ in which they pick) against
msgspec as the reference, EAGLE pairs, every field, and what it refuses. That the typed pass built on it agrees with
the general walk is tests/core/test_engine_common_shape.py's; that C and twin agree on any bytes,
tests/core/test_native_twins.py's."""

from __future__ import annotations

import struct
import sys
from array import array
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvctl.core import native
from kvctl.core._native_py import ENGINE_FIELDS

_INTS = {  # name: (marker, struct format, min, max)
    "u8": (0xCC, ">B", 0, 2**8 - 1), "u16": (0xCD, ">H", 0, 2**16 - 1), "u32": (0xCE, ">I", 0, 2**32 - 1),
    "u64": (0xCF, ">Q", 0, 2**64 - 1), "i8": (0xD0, ">b", -(2**7), 2**7 - 1), "i16": (0xD1, ">h", -(2**15), 2**15 - 1),
    "i32": (0xD2, ">i", -(2**31), 2**31 - 1), "i64": (0xD3, ">q", -(2**63), 2**63 - 1),
}
U64 = 2**64 - 1

pytestmark = pytest.mark.usefixtures("native_impl")  # on the C extension and on its pure-Python twin


def _int(value: int, encoding: str) -> bytes:
    """`value` in the chosen encoding where it fits, else as msgspec would write it."""
    if encoding == "fix" and 0 <= value <= 0x7F:
        return bytes([value])
    if encoding in _INTS:
        marker, fmt, lo, hi = _INTS[encoding]
        if lo <= value <= hi:
            return bytes([marker]) + struct.pack(fmt, value)
    return msgspec.msgpack.encode(value)


def _array(items: list[bytes], header: str) -> bytes:
    n = len(items)
    if header == "fix" and n <= 15:
        head = bytes([0x90 | n])
    elif header == "a32":
        head = b"\xdd" + struct.pack(">I", n)
    else:
        head = b"\xdc" + struct.pack(">H", n)
    return head + b"".join(items)


def stored(**raw: bytes) -> bytes:
    """A batch `[0, [event]]` of one BlockStored whose fields are these msgpack values, in order: the last one ends
    the payload (a reader that runs past it runs past the buffer)."""
    fields = {"type": msgspec.msgpack.encode("BlockStored"), "block_hashes": b"\x91\x01", "token_ids": b"\x91\x01",
              **raw}
    body = bytes([0x80 | len(fields)]) + b"".join(msgspec.msgpack.encode(k) + v for k, v in fields.items())
    return b"\x92\x00\x91" + body


def read(payload: bytes) -> dict[str, Any]:
    ts, dp_rank, events = native.engine_batch_msgpack(payload)
    assert len(events) == 1 and events[0][0] == 0
    return dict(zip(ENGINE_FIELDS, events[0][1], strict=True))


def u32s(data: bytes) -> list[int]:
    out = array("I")
    out.frombytes(data)
    if sys.byteorder == "big":  # pragma: no cover - the u32s are little-endian
        out.byteswap()
    return out.tolist()


def u64s(data: bytes) -> list[int]:
    return array("Q", data).tolist()


@given(st.lists(st.tuples(st.integers(-(2**63), 2**64 - 1) | st.integers(0, 70_000),
                          st.sampled_from(["fix", *_INTS])), max_size=40),
       st.sampled_from(["fix", "a16", "a32"]))
def test_every_int_encoding_reads_as_msgspec_decodes_it(items: list[tuple[int, str]], header: str) -> None:
    raw = _array([_int(v, e) for v, e in items], header)
    values = msgspec.msgpack.decode(raw)
    # hashes: any int, signed ones (SGLang's) taken mod 2^64
    assert u64s(read(stored(block_hashes=raw))["block_hashes"]) == [v & U64 for v in values]
    if all(0 <= v < 2**32 for v in values):  # token ids: u32s
        packed, pairs = read(stored(token_ids=raw))["token_ids"]
        assert (u32s(packed), pairs) == (values, False)
    else:
        with pytest.raises(ValueError):
            native.engine_batch_msgpack(stored(token_ids=raw))


@pytest.mark.parametrize("raw", [b"\x94\xcc\x05\xcc\x06", b"\xdc\x00\x04\xcd\x01\x00\xcd\x02\x00",
                                 b"\x92\x92\x01\x02\x92\x03"], ids=["fixarray", "array16", "pairs"])
@pytest.mark.parametrize("field", ["block_hashes", "token_ids"])
def test_an_array_whose_wide_elements_use_up_the_bytes_is_refused(raw: bytes, field: str) -> None:
    """Four elements in four bytes passes the count check (an element takes at least a byte), but two 2-byte
    elements use them up: the reader must stop at the payload's end, not read past it (.ci/sanitizers caught it)."""
    with pytest.raises(ValueError):
        native.engine_batch_msgpack(stored(**{field: raw}))


@pytest.mark.parametrize(("raw", "tokens"), [
    (msgspec.msgpack.encode([[1, 2], [2, 3]]), ([1, 2, 3], True)),
    (b"\x92\xdc\x00\x02\x01\x02\xdd\x00\x00\x00\x02\x02\xcd\x01\x00", ([1, 2, 256], True)),  # any array header
    (msgspec.msgpack.encode([]), ([], False)),
    (msgspec.msgpack.encode([7, 8]), ([7, 8], False)),
])
def test_eagle_pairs_read_as_the_tokens_dynamo_hashes(raw: bytes, tokens: tuple[list[int], bool]) -> None:
    packed, pairs = read(stored(token_ids=raw))["token_ids"]
    assert (u32s(packed), pairs) == tokens


@pytest.mark.parametrize("tokens", [[[1, 2, 3]], [[1, 2], 3], [1, [2, 3]], [[1, -2]], [[1, 2**32]], [[True, 2]],
                                    [[]], [[1, 2], [3]]], ids=str)
def test_what_is_not_all_pairs_or_all_ids_is_refused(tokens: list[Any]) -> None:
    with pytest.raises(ValueError, match="^not an engine batch the typed pass reads$"):
        native.engine_batch_msgpack(stored(token_ids=msgspec.msgpack.encode(tokens)))


def test_every_field_reads_as_msgspec_decodes_it() -> None:
    event = {"type": "BlockStored", "block_hashes": [1, -1], "token_ids": [5, 6], "parent_block_hash": -(2**63),
             "block_size": 2, "lora_name": "l", "medium": "GPU", "lora_id": 3, "extra_keys": [["a", 1.5], None],
             "group_idx": 0, "kv_cache_spec_kind": "full_attention", "kv_cache_spec_sliding_window": None,
             "locality": "LOCAL", "ownership": None, "session_id": "s", "cache_salt": "salt",
             "lookahead_token_ids": [[9], [10, "t", 1.5, b"\x00"]]}
    ts, dp_rank, events = native.engine_batch_msgpack(msgspec.msgpack.encode([1.25, [event], 3]))
    assert (ts, dp_rank) == (1.25, 3)
    (kind, fields), = events
    got = dict(zip(ENGINE_FIELDS, fields, strict=True))
    assert kind == 0 and u64s(got.pop("block_hashes")) == [1, U64] and u32s(got.pop("token_ids")[0]) == [5, 6]
    assert msgspec.msgpack.decode(got.pop("extra_keys")) == event["extra_keys"]  # kept as its msgpack
    assert got.pop("lookahead_token_ids") is None  # checked, not kept: Dynamo hashes a block's own tokens only
    assert got == {k: v for k, v in event.items() if k in got}
    removed = {"type": "BlockRemoved", "block_hashes": [2**64 - 1], "medium": "CPU"}
    cleared = {"type": "AllBlocksCleared", "locality": "REMOTE"}
    _, rank, (gone, clear) = native.engine_batch_msgpack(msgspec.msgpack.encode([7, [removed, cleared]]))
    assert rank is None and (gone[0], clear[0]) == (1, 2)
    assert dict(zip(ENGINE_FIELDS, clear[1], strict=True))["locality"] == "REMOTE"


@pytest.mark.parametrize("batch", [
    [0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "unknown": 1}]],  # a field no engine sends
    [0, [{"type": "BlockRemoved", "block_hashes": [1], "token_ids": [1]}]],  # a field of another kind
    [0, [{"type": "BlockStored", "block_hashes": [1]}]],  # a required field missing
    [0, [{"type": "Bogus"}]], [0, [{"block_hashes": [1]}]], [0, [[1, 2]]],
    [0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "parent_block_hash": True}]],
    [0, [{"type": "BlockStored", "block_hashes": [1.5], "token_ids": [1]}]],
    [0, [{"type": "AllBlocksCleared", "locality": msgspec.msgpack.Ext(1, b"x")}]],  # an ext in a decoded field
    [0, [{"type": "AllBlocksCleared", "locality": {(1, 2): 3}}]],  # a map keyed by an array
    [0, [{"type": "AllBlocksCleared", "locality": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}]],
    [0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "lookahead_token_ids": [{"a": 1}]}]],
    [0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1],
          "lookahead_token_ids": [msgspec.msgpack.Ext(1, b"")]}]],
    [0, [], -1], [0, [], 2**32], [0, [], None, 1], [True, []], ["0", []], [0],
], ids=lambda b: msgspec.msgpack.encode(b).hex()[:24])
def test_what_the_typed_pass_does_not_read_is_refused(batch: list[Any]) -> None:
    with pytest.raises(ValueError, match="^not an engine batch the typed pass reads$"):
        native.engine_batch_msgpack(msgspec.msgpack.encode(batch))


def _map(*items: Any) -> bytes:
    """A batch `[0, [event]]` whose event map holds these keys and values, in order (a key may come twice)."""
    return bytes([0x92, 0x00, 0x91, 0x80 | len(items) // 2]) + b"".join(msgspec.msgpack.encode(x) for x in items)


def test_a_tag_given_twice_must_agree_and_trailing_bytes_are_refused() -> None:
    fields = ("block_hashes", [1], "token_ids", [1])
    assert native.engine_batch_msgpack(_map("type", "BlockStored", *fields, "type", "BlockStored"))[2][0][0] == 0
    for payload in (_map("type", "BlockStored", *fields, "type", "BlockRemoved"),
                    msgspec.msgpack.encode([0, []]) + b"\x00"):
        with pytest.raises(ValueError):
            native.engine_batch_msgpack(payload)


def _nested(levels: int, inner: bytes) -> bytes:
    return b"\x91" * levels + inner


@pytest.mark.parametrize(("lookahead", "taken"), [
    (_nested(31, b"\x01"), True), (_nested(32, b"\x01"), False),  # 32 levels at most (the field is the first)
    (_nested(31, b"\x90"), True), (_nested(32, b"\x90"), False),
    (b"\x92\x01\xa2\xc3\x28", False),  # a string that is not UTF-8: the walk's decode refuses it too
    (b"\x92\x01\xa2ok", True),
], ids=["id at 32", "id at 33", "empty at 32", "empty at 33", "bad utf-8", "a string"])
def test_lookahead_ids_are_checked_as_the_walk_decodes_them(lookahead: bytes, taken: bool) -> None:
    payload = stored(lookahead_token_ids=lookahead)
    if taken:
        assert read(payload)["lookahead_token_ids"] is None
    else:
        with pytest.raises(ValueError):
            native.engine_batch_msgpack(payload)
