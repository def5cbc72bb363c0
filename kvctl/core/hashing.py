"""Dynamo's block hashes, bit for bit (docs/contract.md).

A router that hashes one byte differently from its engines routes with zero overlap and nobody
notices, so this module follows Dynamo 1.6.1's `compute_block_hash_for_seq` exactly:

- local hash of a full block of B tokens = XXH3-64(seed) over the tokens as consecutive u32 LE;
  a trailing partial block is ignored and B = 0 gives no hashes;
- seed = 1337, plus XXH3-64(lora_name, seed 0) with a LoRA, plus XXH3-64(cache_salt, seed 1) with a salt
  (SGLang's `cache_salt`), mod 2^64: a salt changes only the seed, never the bytes hashed;
- EAGLE blocks (SGLang's bigram pages) hash B + 1 tokens each, block i's window overlapping block i+1's by one;
- multimodal blocks append their mm hashes, sorted, as u64 LE after the token bytes;
- sequence hash: seq[0] = local[0], seq[i] = XXH3-64(le64(seq[i-1]) ‖ le64(local[i]), 1337).

The tokens are packed into one buffer per request (in C, by `array`); the blocks are hashed, and the hashes
chained, in one call each (`native`: the C extension, with the xxHash release the `xxhash` package wraps, or
its pure-Python twin where it is not built): no per-token or per-block Python work where the extension is.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from xxhash import xxh3_64_intdigest

from kvctl.core import native

if TYPE_CHECKING:  # collections.abc.Buffer from Python 3.12 on
    from typing_extensions import Buffer

XXH3_SEED = 1337
U64_MASK = (1 << 64) - 1
_U32_MAX = (1 << 32) - 1

if array("I").itemsize != 4:  # pragma: no cover - no such platform is supported by CPython today
    raise ImportError("kvctl needs a 4-byte unsigned int array type ('I'), which this platform lacks")


def block_seed(lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The XXH3 seed for a request: Dynamo mixes the LoRA name and the cache salt into the seed (it appends
    neither); an empty name or salt is none."""
    seed = XXH3_SEED
    if lora_name:
        seed += xxh3_64_intdigest(lora_name.encode("utf-8"), seed=0)
    if cache_salt:
        seed += xxh3_64_intdigest(cache_salt.encode("utf-8"), seed=1)
    return seed & U64_MASK


def pack_tokens(tokens: Sequence[int] | array[int]) -> memoryview:
    """Token ids as one little-endian u32 buffer; rejects ids outside [0, 2^32) with ValueError."""
    if isinstance(tokens, array) and tokens.typecode == "I":
        packed = tokens
    else:
        try:
            if isinstance(tokens, list):  # fromlist walks a list a fifth faster than the constructor does
                packed = array("I")
                packed.fromlist(tokens)
            else:
                packed = array("I", tokens)
        except OverflowError as exc:
            bad = next(t for t in tokens if not 0 <= t <= _U32_MAX)
            raise ValueError(f"token id {bad} is outside the u32 range [0, 2^32)") from exc
    if sys.byteorder == "big":  # pragma: no cover - exercised only on big-endian hosts
        packed = array("I", packed)
        packed.byteswap()
    return memoryview(packed).cast("B")


def local_block_hashes(
    tokens: Sequence[int] | array[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    mm_hashes: Mapping[int, Iterable[int]] | None = None,
) -> list[int]:
    """Local hashes of every full block; `mm_hashes` maps a block index to that block's mm hashes."""
    if not mm_hashes:
        return packed_block_hashes(tokens, block_size, lora_name=lora_name, cache_salt=cache_salt).tolist()
    if block_size <= 0:
        return []
    buf = pack_tokens(tokens)
    seed = block_seed(lora_name, cache_salt)
    stride = 4 * block_size
    out = []
    for b in range(len(buf) // stride):
        chunk: bytes | memoryview = buf[b * stride : (b + 1) * stride]
        extra = mm_hashes.get(b)
        if extra:
            ordered = sorted(h & U64_MASK for h in extra)
            chunk = bytes(chunk) + struct.pack(f"<{len(ordered)}Q", *ordered)
        out.append(xxh3_64_intdigest(chunk, seed=seed))
    return out


def packed_block_hashes(tokens: Sequence[int] | array[int], block_size: int, *, lora_name: str | None = None,
                        cache_salt: str | None = None, eagle: bool = False) -> array[int]:
    """`local_block_hashes` (no multimodal hashes) as an array('Q'): what a route matches against the index's
    packed edges without an int object per block. `eagle`: the blocks of an EAGLE worker (`eagle_block_hashes`)."""
    if block_size <= 0:
        return array("Q")
    packed = pack_tokens(tokens)
    seed = block_seed(lora_name, cache_salt)
    return eagle_block_hashes(packed, block_size, seed) if eagle else block_hashes_of_packed(packed, block_size, seed)


def block_hashes_of_packed(packed: Buffer, block_size: int, seed: int = XXH3_SEED) -> array[int]:
    """`packed_block_hashes` of token ids already packed as little-endian u32s (`pack_tokens`' layout)."""
    hashes = array("Q")
    if block_size > 0:
        hashes.frombytes(native.xxh3_blocks(packed, 4 * block_size, seed))
    return hashes


def eagle_block_hashes(packed: Buffer, block_size: int, seed: int = XXH3_SEED) -> array[int]:
    """Local hashes of an EAGLE worker's blocks: block i hashes tokens [iB, iB + B + 1), so n blocks need nB + 1
    tokens. SGLang's EAGLE pages key each token with the next one, and Dynamo hashes them so (`is_eagle`)."""
    hashes = array("Q")
    if block_size > 0:
        hashes.frombytes(native.xxh3_blocks(packed, 4 * block_size, seed, 4 * block_size + 4))
    return hashes


def sequence_hashes(local_hashes: Sequence[int]) -> list[int]:
    """Dynamo's chained sequence hashes (the first block's is its local hash, not rehashed); OverflowError for a
    hash outside u64."""
    return native.xxh3_chain(local_hashes, XXH3_SEED)
