"""Hostile input: every decoder fails only with DecodeError, and one bad event costs only itself.

Inputs derive from the real captures and Dynamo dumps: random bytes, truncations, byte flips, and
structural mutations of the decoded objects re-encoded with msgspec.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvctl.core.events import (
    Cleared,
    DecodeError,
    EngineBatch,
    EventEnvelope,
    Removed,
    RouterEvent,
    Stored,
    decode_engine_batch,
    decode_envelope,
    decode_router_event_json,
    encode_envelope,
)
from tests.fixtures_path import FIXTURES
from tests.fuzz.junk import mutated as mutate_one

STREAM_PAYLOADS = sorted(bytes.fromhex(json.loads(line)["payload_hex"])
                         for path in (FIXTURES / "engine-streams").glob("*/*.jsonl")
                         for line in path.read_text().splitlines())
"""Every message of the vLLM 0.34 and SGLang 0.5.23 streams (groups, locality, ownership, salts, EAGLE pairs)."""
ENGINE_PAYLOADS = sorted(p.read_bytes() for p in FIXTURES.glob("**/*.msgpack")) + STREAM_PAYLOADS
# Captures whose events all decode and that hold more than one: the survivors of a corruption.
MULTI_EVENT_BATCHES = [  # each event at its index: none refused, none dropped as Dynamo drops them
    p for p in ENGINE_PAYLOADS if len(msgspec.msgpack.decode(p)[1]) > 1
    and not (decoded := decode_engine_batch(p, default_block_size=16)).errors and not decoded.filtered
]
DUMP_JSON = [line.encode() for line in (FIXTURES / "dynamo-1.6.1" / "dump.jsonl").read_text().splitlines()]
ENVELOPES = [
    encode_envelope(EventEnvelope(7, i, 1_795_312_301_289, "kv-events", p)) for i, p in enumerate(DUMP_JSON)
]

U64 = 2**64
FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_names = st.sampled_from(
    ["BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "GPU", "cpu", "stored", "removed", "cleared"]
)
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), U64 - 1)
    | st.sampled_from([0, -1, 2**63, U64 - 1])
    | st.floats()
    | st.text(max_size=8)
    | _names
    | st.binary(max_size=40)
)
JUNK = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(_names | st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=12,
)


def mutated(seed: Any) -> st.SearchStrategy[Any]:
    """`seed` replaced whole by junk, or with one inner location replaced, deleted or given a junk sibling."""
    return JUNK | mutate_one(seed, JUNK)


def hostile(
    seeds: list[bytes], parse: Callable[[bytes], Any], encode: Callable[[Any], bytes]
) -> st.SearchStrategy[bytes]:
    """Random bytes, truncated seeds, seeds with flipped bytes, and structurally mutated seeds."""
    seed = st.sampled_from(seeds)
    truncated = seed.flatmap(lambda s: st.integers(0, len(s) - 1).map(lambda n: s[:n]))
    flipped = st.tuples(
        seed, st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4)
    ).map(lambda t: _flip(*t))
    structural = seed.flatmap(lambda s: mutated(parse(s))).map(encode)
    return st.binary(max_size=200) | truncated | flipped | structural


def _flip(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for position, value in edits:
        out[position % len(out)] = value
    return bytes(out)


def _check_event(ev: Any) -> None:
    """What a decoded event promises to the index, whatever the input was."""
    assert isinstance(ev, Stored | Removed | Cleared)
    hashes = getattr(ev, "block_hashes", [])
    assert all(type(h) is int and 0 <= h < U64 for h in hashes)
    if isinstance(ev, Stored):
        assert len(ev.tokens_hashes) == len(hashes)
        assert ev.parent_hash is None or 0 <= ev.parent_hash < U64


def _decode_batch(data: bytes) -> EngineBatch | None:
    try:
        batch = decode_engine_batch(data, default_block_size=16)
    except DecodeError:
        return None
    assert (batch.dp_rank is None or 0 <= batch.dp_rank < 2**32) and isinstance(batch.ts, float)
    for ev in batch.events:
        _check_event(ev)
    assert all(isinstance(e, DecodeError) and e.index is not None for e in batch.errors)
    return batch


@FUZZ
@given(hostile(ENGINE_PAYLOADS, msgspec.msgpack.decode, msgspec.msgpack.encode))
def test_engine_batch_raises_only_decode_error(data: bytes) -> None:
    batch = _decode_batch(data)
    if batch is not None:
        raw_events = msgspec.msgpack.decode(data)
        raw_events = raw_events[1] if isinstance(raw_events, list) else raw_events["events"]
        assert len(batch.events) + len(batch.errors) + len(batch.filtered) == len(raw_events)  # each accounted for


@FUZZ
@given(st.sampled_from(MULTI_EVENT_BATCHES), st.data())
def test_one_corrupted_event_costs_only_itself(payload: bytes, data: st.DataObject) -> None:
    raw = msgspec.msgpack.decode(payload)
    victim = data.draw(st.integers(0, len(raw[1]) - 1))
    raw[1][victim] = data.draw(mutated(raw[1][victim]) | JUNK)
    original = decode_engine_batch(payload, default_block_size=16)
    batch = _decode_batch(msgspec.msgpack.encode(raw))
    assert batch is not None
    assert [e.index for e in batch.errors] in ([], [victim])
    assert len(batch.errors) + len(batch.filtered) <= 1
    survivors = [ev for i, ev in enumerate(original.events) if i != victim]
    if batch.errors or batch.filtered:  # refused, or dropped as Dynamo drops it
        assert batch.events == survivors
    else:
        assert batch.events[:victim] + batch.events[victim + 1 :] == survivors


@FUZZ
@given(hostile(DUMP_JSON, msgspec.json.decode, msgspec.json.encode))
def test_router_event_json_raises_only_decode_error(data: bytes) -> None:
    try:
        ev = decode_router_event_json(data)
    except DecodeError:
        return
    assert isinstance(ev, RouterEvent) and 0 <= ev.worker_id < U64 and 0 <= ev.dp_rank < 2**32
    _check_event(ev.data)


@FUZZ
@given(hostile(ENVELOPES, msgspec.msgpack.decode, msgspec.msgpack.encode))
def test_envelope_raises_only_decode_error(data: bytes) -> None:
    try:
        env = decode_envelope(data)
    except DecodeError:
        return
    assert isinstance(env.payload, bytes) and isinstance(env.topic, str) and 0 <= env.sequence < U64
