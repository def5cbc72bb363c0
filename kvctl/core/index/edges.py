"""A read-only walk of a radix tree's edges, for views such as `kvctl tree`'s shared prefixes.

Views need each edge's length and holders, not the node internals (slot bitmasks, cut-off maps) that the
index changes freely: this walk is the one public way down the tree, so only `core/index` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvctl.core.index.node import Node, iter_bits
from kvctl.core.index.radix import RadixTree
from kvctl.core.names import WorkerKey


@dataclass(frozen=True, slots=True)
class Edge:
    """One edge: a run of blocks that the same workers hold whole."""

    blocks: int  # blocks on this edge
    holders: tuple[WorkerKey, ...]  # workers holding the whole edge, in slot order
    partial: int  # workers holding only its first blocks
    children: tuple[Edge, ...]  # the edges below it (empty past the walk's depth)


def edges(tree: RadixTree, *, levels: int) -> tuple[Edge, ...]:
    """The edges below the root, `levels` edges deep, in the tree's own order."""
    return _below(tree, tree.root, levels)


def _below(tree: RadixTree, node: Node, levels: int) -> tuple[Edge, ...]:
    if levels == 0 or not node.children:
        return ()
    return tuple(
        Edge(len(child.locals), tuple(tree.worker_of(s) for s in iter_bits(child.full)), len(child.cutoffs or ()),
             _below(tree, child, levels - 1))
        for child in node.children.values()
    )
