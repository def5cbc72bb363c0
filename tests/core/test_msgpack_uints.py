"""The readers (C, and the pure-Python twin) of a stored event's token ids (`u32le_from_msgpack`) and a removal's hashes
(`u64_from_msgpack`) against msgspec as the reference, over every msgpack int encoding (engines' encoders
differ in which they pick) and over arbitrary bytes."""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvctl.core import native

_INTS = {  # name: (marker, struct format, min, max)
    "u8": (0xCC, ">B", 0, 2**8 - 1), "u16": (0xCD, ">H", 0, 2**16 - 1), "u32": (0xCE, ">I", 0, 2**32 - 1),
    "u64": (0xCF, ">Q", 0, 2**64 - 1), "i8": (0xD0, ">b", -(2**7), 2**7 - 1), "i16": (0xD1, ">h", -(2**15), 2**15 - 1),
    "i32": (0xD2, ">i", -(2**31), 2**31 - 1), "i64": (0xD3, ">q", -(2**63), 2**63 - 1),
}


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


# (reader, array typecode of its output, values it takes: below this bound)
READERS = [("u32le_from_msgpack", "I", 2**32), ("u64_from_msgpack", "Q", 2**64)]

pytestmark = pytest.mark.usefixtures("native_impl")  # on the C extension and on its pure-Python twin


def _read(reader: Callable[[bytes], bytes], typecode: str, raw: bytes) -> list[int]:
    out = array(typecode)
    out.frombytes(reader(raw))
    if typecode == "I" and sys.byteorder == "big":  # pragma: no cover - the u32s are little-endian
        out.byteswap()
    return out.tolist()


def _agrees(raw: bytes, expected: object) -> None:
    for name, typecode, bound in READERS:
        reader = getattr(native, name)
        if isinstance(expected, list) and all(type(v) is int and 0 <= v < bound for v in expected):
            assert _read(reader, typecode, raw) == expected
        else:
            with pytest.raises(ValueError):
                reader(raw)


@given(st.lists(st.tuples(st.integers(-(2**63), 2**64 - 1) | st.integers(0, 70_000),
                          st.sampled_from(["fix", *_INTS])), max_size=40),
       st.sampled_from(["fix", "a16", "a32"]))
def test_every_int_encoding_reads_as_msgspec_decodes_it(items: list[tuple[int, str]], header: str) -> None:
    raw = _array([_int(v, e) for v, e in items], header)
    _agrees(raw, msgspec.msgpack.decode(raw))


@pytest.mark.parametrize("raw", [b"\x94\xcc\x05\xcc\x06", b"\xdc\x00\x04\xcd\x01\x00\xcd\x02\x00"],
                         ids=["fixarray", "array16"])
def test_an_array_whose_wide_elements_use_up_the_bytes_is_refused(raw: bytes) -> None:
    """Four elements in four bytes passes the count check (an element takes at least a byte), but two 2-byte
    elements use them up: the reader must stop at the end, not read past it (.ci/sanitizers caught it)."""
    _agrees(raw, None)


@given(st.binary(max_size=60) | st.builds(lambda head, rest: head + rest, st.sampled_from(
    [b"\x93", b"\xdc\x00\x02", b"\xdd\x00\x00\x00\x01", b"\x91\xcf", b"\x92\xd3"]), st.binary(max_size=20)))
def test_any_bytes_read_as_msgspec_decodes_them_or_are_refused(raw: bytes) -> None:
    try:
        expected = msgspec.msgpack.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError):  # not msgpack at all
        expected = None
    _agrees(raw, expected)
