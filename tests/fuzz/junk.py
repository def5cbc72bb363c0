"""Hostile values shared by the fuzz tests: junk of every msgpack/JSON type, wrong-typed replacements for a
field, deep nesting, huge payloads, and structural mutations of real captures.

Everything here builds inputs; no strategy knows what the code under test should answer (each test has
its own oracle).
"""

from __future__ import annotations

import copy
from typing import Any

import msgspec
from hypothesis import strategies as st

U64 = 2**64
MB = 1 << 20

NAMES = st.sampled_from([
    "BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "GPU", "cpu", "stored", "removed", "cleared",
    "worker_id", "event", "data", "event_id", "dp_rank", "block_hashes", "token_ids", "block_size", "medium",
    "parent_block_hash", "blocks", "block_hash", "tokens_hash", "parent_hash", "storage_tier", "model",
])

# Every type msgpack can carry (ints within what msgpack encodes: [-2^63, 2^64)).
MSGPACK_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), U64 - 1)
    | st.sampled_from([0, -1, 1, 2**31, 2**32, 2**53 + 1, 2**63, U64 - 1, -(2**63)])
    | st.floats()
    | st.text(max_size=12)
    | NAMES
    | st.binary(max_size=40)
)
MSGPACK_JUNK = st.recursive(
    MSGPACK_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(NAMES | st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)

# JSON has no bytes, but Python's json also reads NaN/Infinity and ints of any size.
JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([-1, 2**53 + 1, 2**63, U64 - 1, U64, 2**64 + 1, -(2**63) - 1, 10**30])
    | st.floats()
    | st.text(max_size=12)
    | NAMES
)
JSON_JUNK = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(NAMES | st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)

class Blob(bytes):
    """Bytes with a short repr: a failing example of MBs must still print (and Hypothesis warns, an error
    here, on a repr over 10 kB)."""

    def __repr__(self) -> str:
        head = bytes(self[:24])
        return f"Blob({head!r}{'...' if len(self) > 24 else ''}, {len(self)} bytes)"


WRONG_TYPED = [None, True, -1, U64, 1.5, float("nan"), "x", "", [], [None], {}, {"a": 1}]
"""A value of each kind a field can wrongly hold (bytes added for msgpack); at least one is wrong for any field."""


def deep_msgpack(depth: int, kind: str = "array") -> bytes:
    """`depth` nested 1-element arrays (or 1-key maps) around a nil: nested far past any recursion limit."""
    return (b"\x91" * depth if kind == "array" else b"\x81\xa1k" * depth) + b"\xc0"


def deep_json(depth: int, kind: str = "array") -> bytes:
    return (b"[" * depth + b"]" * depth) if kind == "array" else (b'{"k":' * depth + b"null" + b"}" * depth)


DEPTHS = st.sampled_from([64, 10_000, 100_000])
"""Far from Python's recursion limit (1000): msgspec's depth check counts the caller's own stack, so how a
payload ~1000 deep fails (bad_msgpack, or decoded then bad_batch) depends on where it is decoded."""


def paths(obj: Any, prefix: tuple[Any, ...] = (), *, elements: int = 2) -> list[tuple[Any, ...]]:
    """Every location in a decoded value, the root included. Of a list longer than 8 (data, not a record such as
    `[ts, events, dp_rank]` or a positional event), only the first `elements` items: a 64-token array would
    otherwise crowd out every other field."""
    if isinstance(obj, dict):
        children = list(obj.items())
    elif isinstance(obj, list):
        children = list(enumerate(obj))[: len(obj) if len(obj) <= 8 else elements]
    else:
        children = []
    return [prefix] + [p for key, value in children for p in paths(value, (*prefix, key), elements=elements)]


def replaced(seed: Any, path: tuple[Any, ...], value: Any) -> Any:
    """A deep copy of `seed` with the value at `path` replaced (the root: `value` itself)."""
    if not path:
        return value
    obj = copy.deepcopy(seed)
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return obj


@st.composite
def mutated(draw: st.DrawFn, seed: Any, junk: st.SearchStrategy[Any]) -> Any:
    """A copy of `seed` with one location (not the root: junk alone is that) replaced by junk, deleted, or given an
    extra junk entry. The deepest locations come first, where Hypothesis's choices lean."""
    obj = copy.deepcopy(seed)
    path = draw(st.sampled_from(sorted((p for p in paths(obj) if p), key=len, reverse=True)))
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    action = draw(st.sampled_from(["replace", "delete", "extend"]))
    if action == "replace":
        parent[path[-1]] = draw(junk)
    elif action == "delete":
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[draw(NAMES)] = draw(junk)
    else:
        parent.append(draw(junk))
    return obj


def huge_msgpack_payloads() -> st.SearchStrategy[bytes]:
    """A few MB each: a giant bin, a giant invalid-UTF-8 str, repeated random bytes, a huge token array."""
    size = st.integers(1 * MB, 4 * MB)
    giant_bin = size.map(lambda n: b"\xc6" + n.to_bytes(4, "big") + b"\x00" * n)
    bad_str = size.map(lambda n: b"\xdb" + n.to_bytes(4, "big") + b"\xff" * n)
    repeated = st.tuples(st.binary(min_size=1, max_size=64), size).map(
        lambda t: (t[0] * (t[1] // len(t[0]) + 1))[: t[1]])
    claims_more = st.sampled_from([b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff"])
    huge_batch = st.sampled_from([16, 64]).map(_huge_store_batch)
    return giant_bin | bad_str | repeated | claims_more | huge_batch


def _huge_store_batch(blocks_k: int) -> bytes:
    """A valid vLLM batch: one store of `blocks_k` * 1024 blocks of 16 tokens (64k blocks: over 1 MB)."""
    n = blocks_k * 1024
    event = {"type": "BlockStored", "block_hashes": list(range(1, n + 1)), "parent_block_hash": None,
             "token_ids": [7] * (16 * n), "block_size": 16, "lora_id": None, "medium": "GPU"}
    return msgspec.msgpack.encode([1.0, [event], 0])


def hostile(seeds: list[bytes], parse: Any, encode: Any, junk: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    """Bytes near real ones: random, truncated seeds, seeds with bytes overwritten, structural mutations of the
    parsed seeds re-encoded, and deep nesting."""
    seed = st.sampled_from(seeds)
    truncated = seed.flatmap(lambda s: st.integers(0, max(0, len(s) - 1)).map(lambda n: s[:n]))
    flipped = st.tuples(seed, st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1,
                                       max_size=4)).map(lambda t: _flip(*t))
    structural = seed.flatmap(lambda s: mutated(parse(s), junk)).map(encode)
    return (st.binary(max_size=200) | truncated | flipped | structural | junk.map(encode)).map(Blob)


def _flip(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for position, value in edits:
        if out:
            out[position % len(out)] = value
    return bytes(out)
