"""The read side of a radix tree: how deep each worker holds a query's path (`RadixTree.find_matches`), and the
engine hashes along it. Apart from the tree's writes (`radix.py`, `removal.py`), on the same fields."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvctl.core.index.node import iter_bits
from kvctl.core.names import WorkerKey

if TYPE_CHECKING:
    from kvctl.core.index.radix import RadixTree


@dataclass(slots=True)
class Matches:
    """find_matches' answer: contiguous matched depth per worker, and its tree size."""

    scores: dict[WorkerKey, int] = field(default_factory=dict)
    tree_sizes: dict[WorkerKey, int] = field(default_factory=dict)


def find_matches(tree: RadixTree, local_hashes: Sequence[int], early_exit: bool) -> Matches:
    """Contiguous matched depth, in blocks, of every worker holding a prefix of `local_hashes`."""
    result = Matches()
    n = len(local_hashes)
    if not n:
        return result
    children = tree.root.children
    node = children.get(local_hashes[0]) if children else None
    if node is None:
        return result
    q = local_hashes if isinstance(local_hashes, array) else array("Q", local_hashes)
    slot_scores: dict[int, int] = {}
    depth = 0
    active = 0
    first = True
    while True:
        edge = node.locals
        walk = min(len(edge), n - depth)
        if edge[:walk] == q[depth : depth + walk] if walk < len(edge) else edge == q[depth : depth + walk]:
            m = walk
        else:
            m = common_prefix(edge, q, depth, walk)
        if first:
            active = node.full
            if node.cutoffs:
                for slot, cut in node.cutoffs.items():
                    slot_scores[slot] = cut if cut < m else m
            first = False
        else:
            dropped = active & ~node.full
            if dropped:
                cutoffs = node.cutoffs
                slot_scores.update(dict.fromkeys(iter_bits(dropped), depth))
                if cutoffs:
                    for slot, cut in cutoffs.items():
                        if dropped >> slot & 1:
                            slot_scores[slot] = depth + (cut if cut < m else m)
                active &= node.full
        depth += m
        if not active or m < len(edge) or depth == n or (early_exit and active & (active - 1) == 0):
            break
        children = node.children
        node = children.get(q[depth]) if children else None
        if node is None:
            break
    if active:
        slot_scores.update(dict.fromkeys(iter_bits(active), depth))
    workers, count, lookup, deferred = tree._workers, tree._count, tree._lookup, tree._deferred
    result.scores = {workers[s]: score for s, score in slot_scores.items()}  # type: ignore[misc]
    # `_held`, inlined: a route asks it of every matched worker
    result.tree_sizes = {workers[s]: count[s] if lookup[s] is None  # type: ignore[misc]
                         else len(lookup[s]) - deferred[s].dead for s in slot_scores}  # type: ignore[arg-type]

    return result

def path_hashes(tree: RadixTree, local_hashes: Sequence[int], depths: set[int]) -> dict[int, int]:
    """For each depth d, the engine hash the tree keeps for block d-1 of the path `local_hashes` walks.

    Where a slower tier's walk starts from (Dynamo's `last_matched_hashes`); only depths the path reaches
    (matched ones) are answered. The node's hash is the first storer's: engines that hash the same tokens
    alike (all do, but see `hash_mismatches`) share it."""
    wanted = sorted(d for d in depths if d > 0)
    out: dict[int, int] = {}
    node, depth, i = tree.root, 0, 0
    while i < len(wanted) and depth < len(local_hashes):
        children = node.children
        node = children.get(local_hashes[depth]) if children else None  # type: ignore[assignment]
        if node is None:
            break
        end = depth + len(node.locals)
        while i < len(wanted) and wanted[i] <= end:
            out[wanted[i]] = node.packed[wanted[i] - depth - 1]
            i += 1
        depth = end
    return out


def common_prefix(edge: array[int], q: Sequence[int], start: int, walk: int) -> int:
    """Length of the longest common prefix of edge[:walk] and q[start:start+walk] (binary search on slices)."""
    lo, hi = 0, walk
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if edge[:mid] == q[start : start + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
