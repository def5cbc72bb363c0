"""The typed pass over the common batch shape (`engine._decode_common`) agrees with the general walk
(`engine._decode_any`) on every payload it accepts, and accepts what real vLLM >= 0.24 engines send.

The typed pass exists for speed only; the walk is the reference. Inputs: the real captures, the same
with fields replaced by values of every msgpack type (common-shaped batches with wrong values in them),
and hostile mutations of the captures.
"""

from __future__ import annotations

import math
from array import array
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvctl.core.events import DecodeError, EngineBatch, Removed, Stored, engine
from tests.core.test_events_fuzz import ENGINE_PAYLOADS, STREAM_PAYLOADS, hostile
from tests.fixtures_path import FIXTURES
from tests.fuzz.junk import MSGPACK_SCALARS
from tests.plain_events import plain

SETTINGS = settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VLLM = sorted((FIXTURES / "vllm-0.33").glob("*.msgpack"))

_u64 = st.integers(0, 2**64 - 1)
_odd = MSGPACK_SCALARS | st.sampled_from([-1, -(2**63), 2**32, True, False, b"\x01" * 8, 0])
_hashes = st.lists(_u64, max_size=4) | st.lists(_u64 | _odd, max_size=4) | _odd
_tokens = st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=70) | st.lists(
    st.integers(-5, 2**32 + 5) | _odd, max_size=70) | st.lists(  # EAGLE pairs, and things almost pairs
    st.lists(st.integers(0, 2**32 - 1), min_size=2, max_size=2) | st.lists(st.integers(-1, 2**32) | _odd, max_size=3),
    max_size=40) | _odd
_words = st.none() | st.sampled_from(["", "LOCAL", "REMOTE", "kvcr", "full_attention", "sliding_window", "x"]) | _odd
_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]) | _odd,
    "block_hashes": _hashes,
    "parent_block_hash": st.none() | _u64 | _odd,
    "token_ids": _tokens,
    "block_size": st.sampled_from([None, 1, 4, 16]) | _odd,
    "lora_name": st.none() | st.text(max_size=6) | _odd,
    "medium": st.sampled_from([None, "GPU", "cpu", "CPU_PINNED", "disk", "TAPE"]) | _odd,
    "extra_keys": _odd | st.lists(st.none() | st.lists(st.sampled_from(["a", "dynamo-cache-salt:s"]) | _odd,
                                                      max_size=2), max_size=2),
    "group_idx": st.none() | st.integers(0, 3) | _odd,
    "kv_cache_spec_kind": _words,
    "kv_cache_spec_sliding_window": st.none() | st.integers(0, 256) | _odd,
    "locality": _words,
    "ownership": _words,
    "cache_salt": _words,
    "session_id": _words,
    "lookahead_token_ids": _tokens,
}


@st.composite
def _event(draw: st.DrawFn) -> dict[str, Any]:
    """A map event with some of the fields, each valid or not."""
    names = draw(st.lists(st.sampled_from(sorted(_FIELDS)), unique=True))
    return {name: draw(_FIELDS[name]) for name in ["type", *names]}


_batches = st.tuples(
    st.floats() | st.integers(-(2**63), 2**64 - 1) | _odd,
    st.lists(_event(), max_size=3),
    st.none() | st.integers(-1, 2**32) | _odd,
).flatmap(lambda t: st.sampled_from([list(t), list(t[:2]), [*t, 0]]))


def _assert_agrees(payload: bytes) -> bool:
    """True when the typed pass accepted the payload (and then agreed with the walk)."""
    fast = engine._decode_common(payload, 16)
    if fast is None:
        return False
    slow = engine._decode_any(payload, 16)  # raising here means the typed pass accepted a broken batch
    assert isinstance(fast, EngineBatch) and not fast.errors
    assert not slow.errors, slow.errors
    assert fast.ts == slow.ts or (math.isnan(fast.ts) and math.isnan(slow.ts))
    assert (fast.dp_rank, fast.events, fast.filtered) == (slow.dp_rank, slow.events, slow.filtered)
    packed = engine._decode_common(payload, 16, packed=True)  # as the router's decode process reads
    assert packed is not None and [plain(e) for e in packed.events] == [plain(e) for e in slow.events]
    assert all(type(e.block_hashes) is array for e in packed.events if isinstance(e, Removed))
    assert all(type(e.tokens_hashes) is array for e in packed.events if isinstance(e, Stored))
    return True


def test_real_vllm_batches_take_the_typed_pass_unless_their_hashes_are_bytes() -> None:
    clean = {p.name: p.read_bytes() for p in VLLM if not engine._decode_any(p.read_bytes(), 16).errors}
    assert len(clean) >= 5
    taken = {name for name, payload in clean.items() if _assert_agrees(payload)}
    assert set(clean) - taken == {"g_bytes_hashes.msgpack"}  # digests as bytes: the walk turns them into ints


def test_every_message_of_todays_engines_takes_the_typed_pass() -> None:
    """vLLM 0.34's groups, locality, ownership and lookahead; SGLang 0.5.23's signed hashes, salts and EAGLE pairs:
    none of them falls back to the walk (3x slower), and the typed pass agrees with it on each."""
    refused = [payload[:40] for payload in STREAM_PAYLOADS if not _assert_agrees(payload)]
    assert refused == [] and len(STREAM_PAYLOADS) == 96


@SETTINGS
@given(_batches)
def test_common_shaped_batches_with_any_values_decode_as_the_walk_does(batch: list[Any]) -> None:
    payload = msgspec.msgpack.encode(batch)
    try:
        _assert_agrees(payload)
    except DecodeError:
        raise AssertionError(f"the typed pass accepted a batch the walk rejects: {batch!r}") from None


@SETTINGS
@given(hostile(ENGINE_PAYLOADS, msgspec.msgpack.decode, msgspec.msgpack.encode))
def test_hostile_payloads_decode_as_the_walk_does(payload: bytes) -> None:
    try:
        _assert_agrees(payload)
    except DecodeError:
        raise AssertionError(f"the typed pass accepted a payload the walk rejects: {payload!r}") from None


def test_the_known_extra_keys_cache_is_bounded_in_count_and_bytes() -> None:
    """Each distinct `extra_keys` payload is decoded once and remembered with what a salt is read from (None
    untagged, the first block's keys tagged), but never more than `_KNOWN_KEYS_MAX` of them, none larger than
    `_KNOWN_KEY_BYTES` and none whose first block has more than `_KNOWN_FIRST_KEYS` keys: an engine cannot grow it
    without bound."""
    engine._KNOWN_KEYS.clear()
    large = msgspec.msgpack.encode([["x" * engine._KNOWN_KEY_BYTES]])
    assert engine._salt_keys(large) is None and not engine._KNOWN_KEYS
    wide = msgspec.msgpack.encode([["dynamo-cache-salt:s", *"abcdefgh"], None])
    assert engine._salt_keys(wide) == [["dynamo-cache-salt:s", *"abcdefgh"]] and not engine._KNOWN_KEYS
    salted = msgspec.msgpack.encode([["lora", "dynamo-cache-salt:s"], None, None])
    assert engine._salt_keys(salted) == engine._salt_keys(salted) == [["lora", "dynamo-cache-salt:s"]]
    assert dict(engine._KNOWN_KEYS) == {salted: [["lora", "dynamo-cache-salt:s"]]}
    for n in range(engine._KNOWN_KEYS_MAX + 5):
        assert engine._salt_keys(msgspec.msgpack.encode([[f"lora-{n}"]])) is None
        assert len(engine._KNOWN_KEYS) <= engine._KNOWN_KEYS_MAX
    invalid = b"\x91\x91\xa2\x80x"  # a string that is not UTF-8: refused, and not remembered
    with pytest.raises(UnicodeDecodeError):
        engine._salt_keys(invalid)
    assert invalid not in engine._KNOWN_KEYS
