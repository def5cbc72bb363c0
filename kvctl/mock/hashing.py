"""Engine block hashes, computed the way vLLM and SGLang compute them (not Dynamo's, which routers use).

A mock engine's events must carry the hashes a real engine would send, so a router that keeps
them as opaque ids meets realistic values (u64 from vLLM, signed i64 from SGLang):

- vLLM 0.33 (`sha256`, its default): digest = SHA-256(pickle((parent digest, tokens, extra_keys)))
  with `NONE_HASH = SHA-256(pickle("vllm-none-hash"))` as the first parent; the event carries the
  low 64 bits of the digest, big-endian.
- SGLang 0.5.23: digest = SHA-256(parent digest ‖ tokens as u32 LE); the event carries the first
  16 hex digits of the digest as a signed int64.

`nondeterministic=True` replaces the first parent with random bytes, as vLLM did before its fix
(`NONE_HASH = os.urandom(32)`): then two engines hash the same prefix differently.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from enum import StrEnum

VLLM_NONE_HASH_SEED = "vllm-none-hash"
_PICKLE_PROTOCOL = 5  # pickle.HIGHEST_PROTOCOL of every Python vLLM supports: pinned so hashes never drift
_I64_HALF = 1 << 63


class HashStyle(StrEnum):
    vllm = "vllm"
    sglang = "sglang"


class BlockHasher:
    """Chains full-block hashes from a root, as one engine process does."""

    def __init__(self, style: HashStyle, *, root_seed: bytes | None = None) -> None:
        """`root_seed` (random bytes) makes the chain process-specific; None is the engine's fixed seed."""
        self.style = style
        if root_seed is not None:
            self._root = hashlib.sha256(root_seed).digest()
        elif style is HashStyle.vllm:
            self._root = _vllm_digest(VLLM_NONE_HASH_SEED)
        else:
            self._root = b""  # SGLang hashes the first page with no prior digest

    def chain(self, token_ids: Sequence[int], block_size: int) -> list[tuple[int, tuple[int, ...]]]:
        """(event hash, block tokens) of every full block of `token_ids`; a trailing partial block is skipped."""
        blocks = []
        parent = self._root
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            tokens = tuple(token_ids[start : start + block_size])
            parent = self._digest(parent, tokens)
            blocks.append((self._event_hash(parent), tokens))
        return blocks

    def _digest(self, parent: bytes, tokens: tuple[int, ...]) -> bytes:
        if self.style is HashStyle.vllm:
            return _vllm_digest((parent, tokens, None))
        hasher = hashlib.sha256(parent)
        hasher.update(b"".join(t.to_bytes(4, "little") for t in tokens))
        return hasher.digest()

    def _event_hash(self, digest: bytes) -> int:
        if self.style is HashStyle.vllm:
            return int.from_bytes(digest[-8:], "big")
        value = int.from_bytes(digest[:8], "big")
        return value - (1 << 64) if value >= _I64_HALF else value


def _vllm_digest(value: object) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=_PICKLE_PROTOCOL)).digest()
