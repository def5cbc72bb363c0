"""The token-id reader (C, and its pure-Python twin) against Python's json module as the reference: same
acceptance, same ids, and the refusals worded the way msgspec words them for a `list[int]` bounded to u32 (the
route API's 422s)."""

from __future__ import annotations

import json
from array import array
from typing import Annotated

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvctl.core.token_json import token_ids_from_json

pytestmark = pytest.mark.usefixtures("native_impl")  # on the C extension and on its pure-Python twin

U32_MAX = 2**32 - 1
_WS = st.sampled_from(["", " ", "\n", "\t", "\r\n  "])


def reference(raw: bytes) -> list[int] | None:
    """What the reader must return: the ids of a JSON array of u32 integers, None for anything else."""
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(value, list):
        return None
    if all(type(v) is int and 0 <= v <= U32_MAX for v in value):
        return value
    return None


def read(raw: bytes) -> list[int] | None:
    try:
        return token_ids_from_json(raw).tolist()
    except ValueError:
        return None


@st.composite
def json_arrays(draw: st.DrawFn) -> bytes:
    """Arrays as clients write them: any spacing, mostly ids, sometimes a value that must be refused."""
    items = draw(st.lists(st.one_of(
        st.integers(0, U32_MAX), st.integers(0, 200_000), st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False, allow_infinity=False), st.booleans(), st.none(), st.text(max_size=3),
        st.lists(st.integers(0, 9), max_size=2)), max_size=40))
    parts = [draw(_WS) + json.dumps(item) + draw(_WS) for item in items]
    return f"{draw(_WS)}[{','.join(parts)}]{draw(_WS)}".encode()


@pytest.mark.slow
@settings(max_examples=2000, deadline=None)
@given(json_arrays())
@example(b"[-0]")
@example(b"[0, 4294967295]")
@example(b"[4294967296]")
@example(b"[1e2]")
@example(b"[1.0]")
def test_reads_what_json_reads(raw: bytes) -> None:
    assert read(raw) == reference(raw)


@pytest.mark.slow
@settings(max_examples=3000, deadline=None)
@given(st.binary(max_size=40) | st.text(alphabet="[]0123456789,. -+eE\"nulltrfs{}", max_size=30).map(str.encode))
@example(b"[01]")
@example(b"[1,]")
@example(b"[,1]")
@example(b"[1 2]")
@example(b"[-]")
@example(b"[1.]")
@example(b"[1e]")
@example(b"[]]")
@example(b"[] x")
@example(b"")
@example(b" ")
@example(b"[")
def test_any_bytes_are_read_or_refused_like_json(raw: bytes) -> None:
    assert read(raw) == reference(raw)


@given(st.lists(st.integers(0, U32_MAX), max_size=300))
def test_ids_come_out_as_u32_in_order(ids: list[int]) -> None:
    out = token_ids_from_json(json.dumps(ids).encode())
    assert out.typecode == "I" and out == array("I", ids)


@pytest.mark.parametrize(("raw", "message"), [
    (b"[1, -1]", "Expected `int` >= 0 - at `$.token_ids[1]`"),
    (b"[4294967296]", "Expected `int` <= 4294967295 - at `$.token_ids[0]`"),
    (b"[1, 2, 3.5]", "Expected `int`, got `float` - at `$.token_ids[2]`"),
    (b'[1, "2"]', "Expected `int`, got `str` - at `$.token_ids[1]`"),
    (b"[true]", "Expected `int`, got `bool` - at `$.token_ids[0]`"),
    (b"[[1]]", "Expected `int`, got `array` - at `$.token_ids[0]`"),
    (b'{"a": 1}', "Expected `array`, got `object` - at `$.token_ids`"),
    (b"7", "Expected `array`, got `number` - at `$.token_ids`"),
    (b"[1,, 2]", "JSON is malformed at byte 3 of `$.token_ids`"),
])
def test_refusals_name_the_place(raw: bytes, message: str) -> None:
    with pytest.raises(ValueError) as refused:
        token_ids_from_json(raw)
    assert str(refused.value) == message


def test_bounds_read_as_msgspec_words_them() -> None:
    """The route API's other fields are refused by msgspec: a bad token id must read the same way."""
    class Bounded(msgspec.Struct):
        token_ids: list[Annotated[int, msgspec.Meta(ge=0, le=U32_MAX)]]

    bounded = msgspec.json.Decoder(Bounded)
    for raw in (b"[-1]", b"[4294967296]", b"[1.5]", b'["x"]'):
        with pytest.raises(msgspec.ValidationError) as theirs:
            bounded.decode(b'{"token_ids": ' + raw + b"}")
        with pytest.raises(ValueError) as ours:
            token_ids_from_json(raw)
        assert str(ours.value) == str(theirs.value)


def test_reads_a_msgspec_raw_slice_in_place() -> None:
    class Body(msgspec.Struct):
        token_ids: msgspec.Raw

    body = msgspec.json.decode(b'{"token_ids": [3, 1, 2], "x": 0}', type=Body)
    assert token_ids_from_json(body.token_ids).tolist() == [3, 1, 2]
