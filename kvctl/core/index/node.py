"""The radix tree's parts (`radix.py`): a compressed edge of blocks and who holds it, and what applying an event
did. Kept apart so that the tree and its removals (`removal.py`, the tree's base class) share them."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

# Bit positions of every byte value: turns a bitmask into slot numbers without a per-bit Python loop.
_BYTE_BITS: tuple[tuple[int, ...], ...] = tuple(tuple(b for b in range(8) if v >> b & 1) for v in range(256))


def iter_bits(mask: int) -> list[int]:
    """Slot numbers set in `mask`, ascending."""
    raw = mask.to_bytes((mask.bit_length() + 7) >> 3, "little")
    table = _BYTE_BITS
    return [(i << 3) + b for i, byte in enumerate(raw) if byte for b in table[byte]]


def positions_of(hashes: Sequence[int]) -> dict[int, int]:
    """Engine hash -> its last place in `hashes`."""
    return dict(zip(hashes, range(len(hashes)), strict=True))


class Status(StrEnum):
    """What applying one event did; the values are Dynamo's `kv_cache_events_applied` statuses."""

    ok = "ok"
    parent_block_not_found = "parent_block_not_found"
    block_not_found = "block_not_found"
    invalid_block = "invalid_block"


class ApplyResult(NamedTuple):
    """One per event applied: a tuple, which builds in a third of a frozen dataclass's time."""

    status: Status
    blocks: int = 0  # blocks stored, or removed
    missing: int = 0  # removals of blocks the worker did not hold


OK_EMPTY = ApplyResult(Status.ok)


class Node:
    """A compressed edge of blocks and who holds it; the root has an empty edge.

    An edge's engine hashes (`packed`, 8 B a block: no int object, issue 40) and `locals` only ever grow in place
    (a leaf extended); cutting an edge gives it new ones. So whoever holds those objects and a length keeps a
    prefix that cannot change under it: what lets a dump be captured without copying a block.

    `index` (engine hash -> its last place in the edge) is built only when first read (`positions`): a dict
    entry per block costs ~25 B a held pair, a sixth of the index, and most edges are never read by hash
    (only stored under their last block, or removed, after which they are usually freed). `distinct` says,
    where that is known without it, that no hash is repeated in the edge, which removals and cuts ask.
    """

    __slots__ = ("locals", "packed", "index", "distinct", "full", "cutoffs", "children", "internal", "parent", "freed")

    def __init__(self, locals_: array[int], packed: array[int], parent: Node | None, full: int, *,
                 distinct: bool = False) -> None:
        self.locals = locals_
        self.packed = packed
        self.index: dict[int, int] | None = None  # see `positions`
        self.distinct = distinct  # True: no hash twice in the edge (False: not known)
        self.full = full  # bitmask of slots holding the whole edge
        self.cutoffs: dict[int, int] | None = None  # slot -> k: holds edge[:k], 0 < k < len(edge)
        self.children: dict[int, Node] | None = None  # first local hash of the child's edge -> child
        self.internal = False  # once a node has had children it is never extended again (as Dynamo)
        self.parent = parent
        self.freed = False  # nobody holds it any more and it is out of the tree

    def positions(self) -> dict[int, int]:
        """Engine hash -> its last place in the edge, built on first use and kept up to date from then on."""
        index = self.index
        if index is None:
            index = self.index = positions_of(self.packed)
        return index

    def position(self, h: int) -> int | None:
        """`positions().get(h)`, without building the index for the edge's last block (a store's usual parent,
        a leaf-first eviction's first) or a distinct edge's first."""
        index = self.index
        if index is None:
            hashes = self.packed
            if hashes and hashes[-1] == h:
                return len(hashes) - 1
            if self.distinct and hashes and hashes[0] == h:  # a request evicted from its first block
                return 0
            index = self.positions()
        return index.get(h)

    def indexed_once(self) -> bool:
        """Every place of the edge has its own entry in `positions()`: no hash repeated, none cut away."""
        return self.distinct or len(self.positions()) == len(self.packed)

    def cutoff(self, slot: int) -> int:
        if self.full >> slot & 1:
            return len(self.locals)
        return self.cutoffs.get(slot, 0) if self.cutoffs else 0

    def covers(self, slot: int, pos: int) -> bool:
        if self.full >> slot & 1:
            return True
        return bool(self.cutoffs) and pos < self.cutoffs.get(slot, 0)  # type: ignore[union-attr]

    def has_workers(self) -> bool:
        return bool(self.full or self.cutoffs)

    def promote(self, bit: int, slot: int) -> None:
        if not self.full & bit:
            if self.cutoffs:
                self.cutoffs.pop(slot, None)
            self.full |= bit

    def cover_prefix(self, bit: int, slot: int, k: int) -> None:
        """Hold at least edge[:k] (a store never shortens what a worker holds)."""
        if k >= len(self.locals):
            self.promote(bit, slot)
        elif k > 0 and not self.full & bit:
            if self.cutoffs is None:
                self.cutoffs = {slot: k}
            elif self.cutoffs.get(slot, 0) < k:
                self.cutoffs[slot] = k

    def drop(self, bit: int, slot: int) -> None:
        self.full &= ~bit
        if self.cutoffs:
            self.cutoffs.pop(slot, None)
            if not self.cutoffs:
                self.cutoffs = None


@dataclass(slots=True)
class Deferred:
    """What a worker's lookup still holds of nodes it freed (see `removal.remove`)."""

    dead: int = 0  # entries pointing at freed nodes
    nodes: list[Node] = field(default_factory=list)  # those nodes (and maybe some whose entries have gone)
    base: int = 0  # the lookup's size when `nodes` was last empty

