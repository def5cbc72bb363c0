"""Dynamo 1.6.1's keyed tracking hashes (`keyed-xxh3-v1`): the source's own test vector, the key's checks as
Dynamo words them, and a router that tracks its in-flight requests by them (the interop tier checks them against
the 1.6.1 binary's replica-sync messages)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvctl.core.hashing import local_block_hashes, sequence_hashes
from kvctl.core.router.router import Router
from kvctl.core.tracking_hash import TrackingKey

KEY = TrackingKey(bytes([0x5A]) * 32, "2026-01")
A, B = (1, 0), (2, 0)


def test_the_sources_own_vector() -> None:
    """`keyed_hash_vector_pins_scope_and_chain_framing` (lib/kv-router/src/tracking_hash.rs): every scope field
    and the chain's framing pinned in three numbers."""
    assert KEY.sequence_hashes(list(range(12)), "model-a", 4, routing_group="tenant-a", cache_namespace="cache-a",
                               lora_name="adapter-a") == [4363769719052127296, 14998523962162619427,
                                                          13920914207884994756]


def test_keyed_hashes_are_not_the_public_ones_and_depend_on_the_key_and_model() -> None:
    tokens = list(range(64))
    keyed = KEY.sequence_hashes(tokens, "tiny", 16)
    assert len(keyed) == 4 and keyed != sequence_hashes(local_block_hashes(tokens, 16))
    assert keyed != TrackingKey(bytes(32), "2026-01").sequence_hashes(tokens, "tiny", 16)
    assert keyed != KEY.sequence_hashes(tokens, "other", 16)


@pytest.mark.parametrize(("key", "key_id", "message"), [
    (bytes(31), "k", "must contain exactly 32 raw bytes; found 31"),
    (bytes(32), "", "nonempty router tracking key id"),
    (bytes(32), " k", "without surrounding spaces")])
def test_a_bad_key_is_refused_as_dynamo_refuses_it(key: bytes, key_id: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrackingKey(key, key_id)


def test_a_keyed_router_books_and_matches_in_flight_blocks_by_keyed_hashes(tmp_path: Path) -> None:
    (tmp_path / "key").write_bytes(KEY.key)
    router = Router(block_size=16, rng=random.Random(0), tracking=TrackingKey.read(tmp_path / "key", KEY.key_id),
                    tracking_model="tiny")
    tokens = list(range(64))
    router.route([A], token_ids=tokens, request_id="r", reserve=True)
    assert [r.block_hashes for r in router.sequences.requests()] == [tuple(KEY.sequence_hashes(tokens, "tiny", 16))]
    again = router.route([A, B], token_ids=tokens)
    assert [c.decode_blocks for c in again.candidates] == [4, 4]  # A runs the prompt already: no new blocks there
    with pytest.raises(ValueError, match="keyed tracking hashes need the prompt's token_ids"):
        router.route([A, B], local_hashes=local_block_hashes(tokens, 16))
