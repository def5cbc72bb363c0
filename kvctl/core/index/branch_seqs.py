"""Sequence hash -> child at the device tree's branch points: how a Dynamo frontend's request, its blocks named by
sequence hash (`sequence_path.py`), is found in a tree keyed by local hashes without hashing every child each time.

A system prompt shared by thousands of requests branches thousands of ways, and the child a sequence hash names is
the one whose local hash chains to it from the branch's own sequence hash. Trying each child cost ~270 ns a child at
10M pairs, 3-5 ms a request (issue 44). A branch point the walk has reached keeps its children keyed by the
sequence hash they chain to (a `native.U64Map`, 16 B an entry), built in one pass and then kept exact by the tree:
a child adopted or let go is added or taken out, and a split hands the map to the node that takes the children.
A map is only used from the sequence hash it was built from, so one that went stale by any other path is rebuilt,
never trusted. At most `MAX_ENTRIES` children are kept in all, the least recently used branch dropped first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvctl.core import native
from kvctl.core.hashing import XXH3_SEED

if TYPE_CHECKING:
    from kvctl.core._native_py import U64Map
    from kvctl.core.index.node import Node

WIDE = 32
"""Children a branch point has, at least, for its map to be kept: a narrower one is hashed whole at each look."""
MAX_ENTRIES = 1 << 20
"""Children keyed in all kept maps, at most (~32 MiB of slots): a fleet's system prompts, many times over."""


class _Branch:
    __slots__ = ("previous", "children")

    def __init__(self, previous: int, children: U64Map) -> None:
        self.previous = previous  # the sequence hash of the branch point's last block
        self.children = children  # sequence hash of a child's first block -> the child


class BranchSeqs:
    """The kept branch maps of one device tree, told by it of every change to a mapped branch's children."""

    def __init__(self, wide: int = WIDE) -> None:
        self.wide = wide
        self.kept: dict[Node, _Branch] = {}  # in order of last use, the oldest first; while empty, the tree skips it
        self.entries = 0

    def cost(self, node: Node, previous: int) -> int:
        """Children a look at `node`'s children from `previous` hashes: none where its map is kept."""
        branch = self.kept.get(node)
        return 0 if branch is not None and branch.previous == previous else len(node.children or ())

    def child(self, node: Node, previous: int, target: int) -> Node | None:
        """The child of `node` whose first block has sequence hash `target`, `previous` being that of `node`'s last
        block; None when no child has."""
        branch = self.kept.pop(node, None)
        if branch is not None and branch.previous != previous:  # reached by another path: not to be trusted
            self.entries -= len(branch.children)
            branch = None
        if branch is None:
            branch = _Branch(previous, native.by_sequence(node.children or {}, previous, XXH3_SEED))
            self.entries += len(branch.children)
        if len(branch.children) >= self.wide:
            self.kept[node] = branch  # the most recently used, last
            while self.entries > MAX_ENTRIES and len(self.kept) > 1:
                self.dropped(next(iter(self.kept)))
        else:
            self.entries -= len(branch.children)  # narrow: hashed whole at each look
        found: Node | None = branch.children.get(target)
        return found

    def adopted(self, node: Node, key: int, child: Node) -> None:
        """`node` took `child` under local hash `key`."""
        branch = self.kept.get(node)
        if branch is not None:
            before = len(branch.children)
            branch.children[_chained(branch.previous, key)] = child
            self.entries += len(branch.children) - before

    def released(self, node: Node, key: int) -> None:
        """`node` let go of its child under local hash `key`."""
        branch = self.kept.get(node)
        if branch is not None and branch.children.pop(_chained(branch.previous, key), None) is not None:
            self.entries -= 1

    def moved(self, node: Node, to: Node) -> None:
        """`to` took every child of `node`, and ends where `node` ended (a split)."""
        branch = self.kept.pop(node, None)
        if branch is not None:
            self.kept[to] = branch

    def dropped(self, node: Node) -> None:
        """`node` let go of all its children, or is gone."""
        branch = self.kept.pop(node, None)
        if branch is not None:
            self.entries -= len(branch.children)


def _chained(previous: int, key: int) -> int:
    return native.xxh3_chain((previous, key), XXH3_SEED)[1]
