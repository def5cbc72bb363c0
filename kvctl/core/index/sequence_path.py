"""A request's blocks found by their sequence hashes, the form a Dynamo frontend publishes them in (its replica
sync's `AddRequest.token_sequence`), while the device tree is keyed by local hashes.

A sequence hash cannot be undone into its local hash, but the tree holds every local hash any worker stores:
walking it from the root and chaining each edge's local hashes (`seq[i] = XXH3(le64(seq[i-1]) || le64(local[i]))`,
the first block's sequence hash being its local hash) finds the longest prefix any worker holds, which bounds
every worker's overlap. Past it no worker holds a block, so nothing is lost by stopping there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvctl.core import native
from kvctl.core.hashing import XXH3_SEED
from kvctl.core.index.branch_seqs import BranchSeqs
from kvctl.core.index.radix import RadixTree

BRANCH_BUDGET = 262_144
"""Children hashed at branch points not mapped yet, per request, at most (~20 ns each, in C; `branch_seqs.py`): a
prefix shared by very many prompts must not make one lookup cost milliseconds. Past it the walk stops and says so
(`Path.exhausted`)."""


@dataclass(frozen=True, slots=True)
class Path:
    """The local hashes of the longest prefix of a request's sequence hashes that the tree holds."""

    local_hashes: list[int]
    exhausted: bool = False
    """The walk gave up at a branch point with more children than its budget: the prefix may be longer."""


def path_of_sequence(tree: RadixTree, sequence_hashes: Sequence[int], budget: int = BRANCH_BUDGET,
                     branches: BranchSeqs | None = None) -> Path:
    """The local hashes of the longest prefix of `sequence_hashes` that is a path from `tree`'s root. `branches`:
    the maps of its branch points to use (the tree's own, which it keeps whole; fresh ones hash every child)."""
    branches = tree.branches if branches is None else branches
    n = len(sequence_hashes)
    children = tree.root.children
    node = children.get(sequence_hashes[0]) if n and children else None
    found: list[int] = []
    previous: int | None = None
    while node is not None:
        depth = len(found)
        edge = list(node.locals[:n - depth])
        chain = native.xxh3_chain(edge, XXH3_SEED) if previous is None else \
            native.xxh3_chain([previous, *edge], XXH3_SEED)[1:]
        k = 0
        for got, want in zip(chain, sequence_hashes[depth:depth + len(edge)], strict=True):
            if got != want:
                break
            k += 1
        found.extend(edge[:k])
        if k < len(node.locals) or len(found) == n or not node.children:
            break
        previous = chain[-1]
        cost = branches.cost(node, previous)
        if cost > budget:
            return Path(found, exhausted=True)
        budget -= cost
        node = branches.child(node, previous, sequence_hashes[len(found)])
    return Path(found)
