"""Dynamo 1.6.1's keyed tracking hashes (`--router-tracking-hash keyed-xxh3-v1`, `lib/kv-router/src/tracking_hash.rs`).

A frontend so configured tracks each in-flight request by sequence hashes keyed with a 32-byte secret, and shares
those with its replicas: a router hashing prompts publicly never matches them, and prices every shared prefix in
flight as new decode load. The index and its lookups stay public (seed 1337). Keyed: a BLAKE3 keyed hash over a
domain tag and the request's scope, framed, gives two u64 seeds, one for each block's XXH3-64 over its u32 LE
tokens, one for the chain (`seq[0] = local[0]`, `seq[i] = XXH3-64(le64(seq[i-1]) ‖ le64(local[i]))`). A LoRA and
a cache namespace enter through the scope, not the public seed.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvctl.core import native
from kvctl.core.hashing import pack_tokens

PUBLIC, KEYED = "public-xxh3-v1", "keyed-xxh3-v1"
DOMAIN = b"dynamo.router.tracking-hash/keyed-xxh3-v1\0"
KEY_BYTES = 32
ROUTING_GROUP = "default"
"""The routing group a frontend hashes under unless it is given one (Dynamo's DEFAULT_TRACKING_ROUTING_GROUP)."""


@dataclass(frozen=True, slots=True)
class TrackingKey:
    """The secret (`--router-tracking-key-file`: exactly 32 raw bytes) and its id (`--router-tracking-key-id`)."""

    key: bytes
    key_id: str

    def __post_init__(self) -> None:
        if len(self.key) != KEY_BYTES:
            raise ValueError(f"router tracking key file must contain exactly {KEY_BYTES} raw bytes; found "
                             f"{len(self.key)}")
        if not self.key_id or self.key_id != self.key_id.strip():
            raise ValueError("keyed-xxh3-v1 requires a nonempty router tracking key id, without surrounding spaces")

    @classmethod
    def read(cls, path: Path, key_id: str) -> TrackingKey:
        return cls(path.read_bytes(), key_id)

    def seeds(self, model: str, block_size: int, *, routing_group: str = ROUTING_GROUP,
              cache_namespace: str | None = None, lora_name: str | None = None, eagle: bool = False) -> tuple[int, int]:
        """(block seed, chain seed) of a request's scope."""
        import blake3  # only a router given a key loads it

        h = blake3.blake3(key=self.key)
        h.update(DOMAIN)
        for tag, value in ((1, self.key_id.encode()), (2, model.encode()), (3, routing_group.encode()),
                           (4, struct.pack("<I", block_size))):
            h.update(_frame(tag, value))
        for tag, text in ((5, cache_namespace), (6, lora_name)):
            h.update(bytes([tag, 1]) + _frame_body(text.encode()) if text else bytes([tag, 0]))
        h.update(_frame(7, bytes([int(eagle)])))
        digest = h.digest()
        block_seed, chain_seed = struct.unpack("<QQ", digest[:16])
        return block_seed, chain_seed

    def sequence_hashes(self, tokens: Sequence[int] | array[int], model: str, block_size: int, *,
                        lora_name: str | None = None, routing_group: str = ROUTING_GROUP,
                        cache_namespace: str | None = None) -> list[int]:
        """The keyed sequence hashes of a prompt's full blocks, as the frontend tracks the request."""
        block_seed, chain_seed = self.seeds(model, block_size, routing_group=routing_group,
                                            cache_namespace=cache_namespace, lora_name=lora_name)
        local = array("Q")
        local.frombytes(native.xxh3_blocks(pack_tokens(tokens), 4 * block_size, block_seed))
        return native.xxh3_chain(local, chain_seed)


def _frame(tag: int, value: bytes) -> bytes:
    return bytes([tag]) + _frame_body(value)


def _frame_body(value: bytes) -> bytes:
    return struct.pack("<Q", len(value)) + value
