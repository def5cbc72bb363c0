"""The pure-Python twin of each C function (`_native_py` against `_native`) over the same inputs: the same
result, or the same exception with the same message, so that an install without a compiler behaves as one
with. The inputs lean on the edges: every XXH3 length class, u32/u64 bounds, bad JSON and msgpack of every
kind, arguments of the wrong type."""

from __future__ import annotations

import json
from array import array
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvctl.core import _native_py
from tests.core.test_engine_batch_msgpack import _INTS, _array, _int, stored
from tests.core.test_engine_common_shape import _batches

# Nothing to compare the twin with where this install built no extension (no compiler at install time).
C = pytest.importorskip("kvctl.core._native", reason="the C extension is not built in this install")


def _outcome(function: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    try:
        return "returned", function(*args)
    except Exception as exc:  # noqa: BLE001 - the exception is the outcome compared
        return type(exc).__name__, str(exc)


def _same(name: str, *args: Any) -> None:
    assert _outcome(getattr(_native_py, name), *args) == _outcome(getattr(C, name), *args)


_INTISH = st.one_of(st.integers(-(2**65), 2**65), st.integers(0, 2**64 - 1), st.integers(-3, 300), st.booleans(),
                    st.floats(allow_nan=False), st.none(), st.text(max_size=2))


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=600), st.integers(1, 260) | _INTISH, st.integers(0, 2**64 - 1) | _INTISH)
@example(b"abc", 0, 1)
@example(b"abc", -1, 1)
@example(b"abc", 2**63, 1)
@example(b"abcd", 2, -1)
@example(b"abcd", 2, 2**64)
def test_xxh3_blocks(data: bytes, stride: Any, seed: Any) -> None:
    _same("xxh3_blocks", data, stride, seed)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200), st.integers(1, 40) | _INTISH, st.integers(0, 2**64 - 1) | _INTISH,
       st.integers(-2, 60) | _INTISH)
@example(b"abcdefgh", 4, 1, 8)  # window = the whole buffer: one block
@example(b"abcdefgh", 4, 1, 9)  # a window longer than the buffer: none
@example(b"abcdefgh", 4, 1, 3)  # narrower than the stride: refused
def test_xxh3_blocks_with_a_window(data: bytes, stride: Any, seed: Any, window: Any) -> None:
    """A window wider than the stride (EAGLE's B + 1 tokens at every B)."""
    _same("xxh3_blocks", data, stride, seed, window)


@st.composite
def _engine_batches(draw: st.DrawFn) -> bytes:
    """Batches of events of any fields and values (the typed pass's own property test's), ints in every encoding
    where they stand alone, maybe cut short or followed by a stray byte."""
    raw = msgspec.msgpack.encode(draw(_batches))
    return raw[: draw(st.integers(0, len(raw)))] if draw(st.booleans()) else raw + draw(st.binary(max_size=1))


@settings(max_examples=1500, deadline=None)
@given(_engine_batches() | st.binary(max_size=60))
@example(msgspec.msgpack.encode([0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [[1, 2], [2, 3]]}]]))
@example(msgspec.msgpack.encode([0, [{"type": "AllBlocksCleared", "locality": msgspec.msgpack.Ext(-1, b"1234")}]]))
@example(msgspec.msgpack.encode([0, [{"type": "AllBlocksCleared", "locality": {(1,): 2}}]]))
@example(msgspec.msgpack.encode([0, [], 2**32]))
@example(b"\x93\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00\x90\xc0")  # a NaN timestamp
def test_engine_batch_msgpack(raw: bytes) -> None:
    # by repr: a NaN timestamp equals itself there, and nowhere else
    assert repr(_outcome(_native_py.engine_batch_msgpack, raw)) == repr(_outcome(C.engine_batch_msgpack, raw))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(-(2**63), 2**64 - 1) | st.integers(0, 300), st.sampled_from(["fix", *_INTS])),
                max_size=20), st.sampled_from(["fix", "a16", "a32"]), st.sampled_from(["block_hashes", "token_ids"]))
def test_engine_batch_msgpack_over_every_int_encoding(items: list[tuple[int, str]], header: str, field: str) -> None:
    _same("engine_batch_msgpack", stored(**{field: _array([_int(v, e) for v, e in items], header)}))


def test_xxh3_blocks_takes_what_a_buffer_is() -> None:
    from array import array

    for data in (bytearray(b"12345678"), memoryview(b"12345678"), array("I", [1, 2, 3, 4]), "text", 7,
                 memoryview(b"12345678")[::2]):
        _same("xxh3_blocks", data, 4, 1337)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1) | _INTISH, max_size=30) | _INTISH | st.tuples(st.integers(0, 9)),
       st.integers(0, 2**64 - 1) | _INTISH)
def test_xxh3_chain(hashes: Any, seed: Any) -> None:
    _same("xxh3_chain", hashes, seed)


def test_xxh3_chain_takes_any_iterable_and_returns_ints() -> None:
    _same("xxh3_chain", range(5), 1337)
    _same("xxh3_chain", {3: None}.keys(), 1337)
    outcome = _outcome(_native_py.xxh3_chain, [True, False], 0)
    assert outcome == _outcome(C.xxh3_chain, [True, False], 0)
    assert [type(h) for h in outcome[1]] == [int, int]


_JSON_ITEM = st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 3), st.integers(-(2**70), 2**70),
                       st.floats(allow_nan=False), st.booleans(), st.none(), st.text(max_size=3),
                       st.lists(st.integers(0, 9), max_size=2),
                       st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))
_JSON_WS = st.sampled_from(["", " ", "\n", "\t", "\r\n  ", "\x0b", "\x0c"])


@st.composite
def _json_texts(draw: st.DrawFn) -> bytes:
    """Arrays of ids as clients write them, sometimes with a value or a byte that must be refused."""
    parts = [draw(_JSON_WS) + draw(st.sampled_from(["", "-", "0"])) + json.dumps(item) + draw(_JSON_WS)
             for item in draw(st.lists(_JSON_ITEM, max_size=12))]
    text = f"{draw(_JSON_WS)}[{','.join(parts)}]{draw(_JSON_WS)}"
    return (text + draw(st.sampled_from(["", "", "x", ",", "]", "[]"]))).encode()


_JSON_BYTES = (_json_texts() | st.binary(max_size=30)
               | st.text(alphabet="[]{}0123456789,.-+eE\" \t\nnulltrfs:_okenid", max_size=30).map(str.encode))


@settings(max_examples=1000, deadline=None)
@given(_JSON_BYTES)
@example(b"")
@example(b"7")
@example(b"-")
@example(b"[-0, 0, 4294967295]")
@example(b"[-1]")
@example(b"[4294967296]")
@example(b"[-4294967296.5]")
@example(b"[1e]")
@example(b"[1e+]")
@example(b"[01]")
@example(b"[00]")
@example(b"[1.]")
@example(b"[] ]")
@example(b"[1234567,12345678,123]")
def test_u32_from_json(raw: bytes) -> None:
    _same("u32_from_json", raw)


@st.composite
def _route_bodies(draw: st.DrawFn) -> bytes:
    ws = _JSON_WS
    ids = draw(_json_texts()).decode()
    rest = draw(st.sampled_from(["}", ', "model": "m"}', ",}", ", 7}", "", ' ,\n"x":1}', "]}"]))
    key = draw(st.sampled_from(['"token_ids"', '"token_ids"', '"tokens"', "token_ids"]))
    return f"{draw(ws)}{{{draw(ws)}{key}{draw(ws)}:{draw(ws)}{ids}{rest}".encode()


@settings(max_examples=1000, deadline=None)
@given(_route_bodies() | _JSON_BYTES)
@example(b'{"token_ids": [1, 2], "model": "m"}')
@example(b'{"token_ids":[1,[2]]}')
@example(b'{"token_ids":["]"]}')
@example(b'{"token_ids":[1]')
@example(b'{"token_ids":[1] }')
def test_u32_head_of_object(raw: bytes) -> None:
    _same("u32_head_of_object", raw)


def test_the_readers_refuse_what_is_not_a_buffer() -> None:
    for name in ("u32_from_json", "u32_head_of_object", "engine_batch_msgpack"):
        for value in ("[1]", 7, None, memoryview(b"[1, 2]")[::2]):
            _same(name, value)


_HELD = ("node", "other", "moved")  # lookup values: the node bound to, another node, the node keys move from


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(st.integers(0, 9), st.sampled_from(_HELD), max_size=8),
       st.lists(st.integers(0, 12), max_size=12), st.sampled_from(["moved", None]))
@example({1: "node", 2: "moved", 3: "other"}, [4, 1, 2, 3, 5], "moved")
@example({1: "other"}, [2, 2, 1], None)
def test_bind_run(held: dict[int, str], keys: list[int], replaceable: str | None) -> None:
    """Both bind the same keys and stop at the same one; identity decides (values are objects, as nodes are)."""
    values = {name: object() for name in _HELD}
    names = {id(v): name for name, v in values.items()}
    outcomes = []
    for impl in (_native_py, C):
        lookup = {k: values[v] for k, v in held.items()}
        done = impl.bind_run(lookup, keys, values["node"], None if replaceable is None else values[replaceable])
        outcomes.append((done, {k: names[id(v)] for k, v in lookup.items()}))
    assert outcomes[0] == outcomes[1]


def test_bind_run_refuses_what_the_other_refuses() -> None:
    for args in (([], [1], 1, None), ({}, 7, 1, None), ({}, [[1]], 1, None)):
        _same("bind_run", *args)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 5), max_size=300), st.binary(max_size=9))
def test_u64s_distinct(hashes: list[int], tail: bytes) -> None:
    from array import array

    packed = array("Q", hashes)
    assert C.u64s_distinct(packed) == (len(set(hashes)) == len(hashes))
    _same("u64s_distinct", packed)
    _same("u64s_distinct", packed.tobytes() + tail)
    for value in ("text", 7, memoryview(packed.tobytes())[::2]):
        _same("u64s_distinct", value)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 7, 2**63, 2**64 - 1]) | st.integers(0, 2**64 - 1), max_size=300),
       st.binary(max_size=7))
def test_u64_counts(values: list[int], tail: bytes) -> None:
    """Every value once, with its count, in the order values first occur (past the table's growth too)."""
    data = array("Q", values)
    counted = array("Q", C.u64_counts(data))
    assert list(zip(counted[::2], counted[1::2], strict=True)) == list(Counter(values).items())
    _same("u64_counts", data)
    _same("u64_counts", data.tobytes() + tail)
    _same("u64_counts", "text")


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(st.integers(0, 2**64 - 1) | _INTISH, st.integers(), max_size=20) | _INTISH,
       st.integers(0, 2**64 - 1) | _INTISH, st.integers(0, 2**64 - 1) | _INTISH)
def test_by_sequence(children: Any, previous: Any, seed: Any) -> None:
    def entries(function: Callable[..., Any]) -> tuple[str, Any]:
        kind, got = _outcome(function, children, previous, seed)
        return (kind, sorted(got.items())) if kind == "returned" else (kind, got)

    assert entries(_native_py.by_sequence) == entries(C.by_sequence)
    if isinstance(children, dict) and children and all(type(v) is int and 0 <= v < 2**64
                                                       for v in (previous, seed, *children)):
        key, value = next(iter(children.items()))  # the map says where each child's block chains to
        assert C.by_sequence(children, previous, seed)[C.xxh3_chain([previous, key], seed)[1]] == value


def _tree_of(stores: list[tuple[int, int, list[int]]], removals: list[tuple[int, list[int]]]) -> Any:
    """A radix tree of the given stores (worker, parent depth, local hashes) and removals, hashes by path."""
    from kvctl.core.index import RadixTree

    tree = RadixTree()
    paths: list[tuple[int, ...]] = []
    for worker, parent_at, symbols in stores:
        parent = paths[parent_at % len(paths)] if paths and parent_at >= 0 else ()
        new = [(*parent, *symbols[: i + 1]) for i in range(len(symbols))]
        tree.store((worker, 0), hash(parent) & (2**64 - 1) if parent else None,
                   [hash(p) & (2**64 - 1) for p in new], [p[-1] for p in new])
        paths.extend(new)
    for worker, picks in removals:
        if paths:
            tree.remove((worker, 0), [hash(paths[i % len(paths)]) & (2**64 - 1) for i in picks])
    return tree


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, 1, 2, 70]), st.integers(-1, 30), st.lists(st.integers(1, 3), min_size=1,
                                                                                       max_size=4)), max_size=25),
       st.lists(st.tuples(st.sampled_from([0, 1, 2, 70]), st.lists(st.integers(0, 60), max_size=3)), max_size=6),
       st.sampled_from([-1, 1, 2, 3, 1 << 70, (1 << 70) | 1]), st.integers(0, 2**20))
def test_solo_split(stores: list[tuple[int, int, list[int]]], removals: list[tuple[int, list[int]]], allowed: int,
                    above: int) -> None:
    """The same runs (as a multiset: both walk depth first, in their own order), the same other nodes in order, the
    same count, over trees of up to 71 worker slots (masks past 64 bits)."""
    tree = _tree_of(stores, removals)
    children = list((tree.root.children or {}).values())
    results = []
    for impl in (_native_py, C):
        runs, rest, counted = impl.solo_split(children, allowed, above)
        results.append((sorted(memoryview(runs).cast("Q")), [id(n) for n in rest], counted))
    assert results[0] == results[1]


def test_solo_split_refuses_what_the_other_refuses() -> None:
    for args in ((7, -1, 0), ([object()], -1, 0), ([], -1, -1), ([], "x", 0)):
        _same("solo_split", *args)
