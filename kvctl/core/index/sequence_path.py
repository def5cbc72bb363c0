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
from kvctl.core.index.node import Node

BRANCH_BUDGET = 262_144
"""Children tried at branch points, per request, at most (~20 ns each, in C): a prefix shared by very many prompts
must not make one lookup cost milliseconds. Past it the walk stops and says so (`Path.exhausted`)."""


@dataclass(frozen=True, slots=True)
class Path:
    """The local hashes of the longest prefix of a request's sequence hashes that the tree holds."""

    local_hashes: list[int]
    exhausted: bool = False
    """The walk gave up at a branch point with more children than its budget: the prefix may be longer."""


def path_of_sequence(root: Node, sequence_hashes: Sequence[int], budget: int = BRANCH_BUDGET) -> Path:
    """The local hashes of the longest prefix of `sequence_hashes` that is a path from `root` (a device tree's)."""
    n = len(sequence_hashes)
    children = root.children
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
        children = node.children
        if k < len(node.locals) or len(found) == n or not children:
            break
        if len(children) > budget:
            return Path(found, exhausted=True)
        budget -= len(children)
        previous = chain[-1]
        node = _child_of(children, previous, sequence_hashes[len(found)])
    return Path(found)


def _child_of(children: dict[int, Node], previous: int, target: int) -> Node | None:
    """The child whose first block chains from `previous` to `target`, every child tried in C (a prompt shared by
    thousands of requests branches thousands of ways)."""
    local = native.chained_child(children, previous, target, XXH3_SEED)
    return None if local is None else children[local]
