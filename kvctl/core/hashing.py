"""Dynamo's block hashes, bit for bit (docs/contract.md).

A router that hashes one byte differently from its engines routes with zero overlap and nobody
notices, so this module follows Dynamo 1.6.1's `compute_block_hash_for_seq` exactly:

- local hash of a full block of B tokens = XXH3-64(seed) over the tokens as consecutive u32 LE;
  a trailing partial block is ignored and B = 0 gives no hashes;
- seed = 1337, or (1337 + XXH3-64(lora_name, seed 0)) mod 2^64 with a LoRA;
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


def lora_seed(lora_name: str | None) -> int:
    """The XXH3 seed for a request: Dynamo mixes the LoRA name into the seed (it does not append it)."""
    if not lora_name:
        return XXH3_SEED
    return (XXH3_SEED + xxh3_64_intdigest(lora_name.encode("utf-8"), seed=0)) & U64_MASK


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
    mm_hashes: Mapping[int, Iterable[int]] | None = None,
) -> list[int]:
    """Local hashes of every full block; `mm_hashes` maps a block index to that block's mm hashes."""
    if not mm_hashes:
        return packed_block_hashes(tokens, block_size, lora_name=lora_name).tolist()
    if block_size <= 0:
        return []
    buf = pack_tokens(tokens)
    seed = lora_seed(lora_name)
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


def packed_block_hashes(tokens: Sequence[int] | array[int], block_size: int, *,
                        lora_name: str | None = None) -> array[int]:
    """`local_block_hashes` (no multimodal hashes) as an array('Q'): what a route matches against the index's
    packed edges without an int object per block."""
    if block_size <= 0:
        return array("Q")
    return block_hashes_of_packed(pack_tokens(tokens), block_size, lora_name=lora_name)


def block_hashes_of_packed(packed: Buffer, block_size: int, *, lora_name: str | None = None) -> array[int]:
    """`packed_block_hashes` of token ids already packed as little-endian u32s (`pack_tokens`' layout)."""
    hashes = array("Q")
    if block_size > 0:
        hashes.frombytes(native.xxh3_blocks(packed, 4 * block_size, lora_seed(lora_name)))
    return hashes


def sequence_hashes(local_hashes: Sequence[int]) -> list[int]:
    """Dynamo's chained sequence hashes (the first block's is its local hash, not rehashed); OverflowError for a
    hash outside u64."""
    return native.xxh3_chain(local_hashes, XXH3_SEED)
