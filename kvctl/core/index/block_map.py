"""The index's one engine hash -> node map, shared by every worker (issue 40).

Dynamo keeps a lookup per worker: a dict entry per (worker, block) pair, which made up half of a restore and a
third of the memory per pair. Here a worker holds a hash where the map's node covers its place for the worker
(`Node.covers`), so a block many workers hold is one entry, and a store along a path already indexed binds
nothing. `RadixTree` keeps a worker in the map while the map can describe it and gives it a lookup of its own
otherwise (`RadixTree._privatize`); this module only keeps the map: binding, moving a cut edge's hashes, and
letting go of freed nodes' entries lazily.
"""

from __future__ import annotations

from array import array
from itertools import repeat

from kvctl.core import native
from kvctl.core.index.node import Node


class BlockMap:
    """Engine hash -> the node holding it; entries of freed nodes wait in `freed` for `release`."""

    __slots__ = ("freed", "freed_entries", "nodes")

    def __init__(self) -> None:
        self.nodes = native.U64Map()  # the hash itself in the slot: no int object per block
        self.freed: list[Node] = []  # freed nodes whose entries are not popped yet
        self.freed_entries = 0  # their hashes: at least the map's dead entries

    def bind(self, keys: array[int], node: Node) -> bool:
        """Bind `keys` to `node`; False at a key some worker holds at another node (the caller's worker cannot
        be described by the map then). A key bound to a node where nobody holds it any more is taken over."""
        nodes = self.nodes
        done = nodes.bind_run(keys, node, None)
        while done < len(keys):
            h = keys[done]
            other = nodes[h]
            if not other.freed:
                pos = other.position(h)
                if pos is not None and (other.full or any(cut > pos for cut in (other.cutoffs or {}).values())):
                    return False
            nodes[h] = node
            done += 1
            done += nodes.bind_run(keys[done:], node, None)
        return True

    def move(self, keys: array[int], old: Node, new: Node | None) -> None:
        """A cut edge's suffix: its keys bound to `old` now name `new`, or nothing when the suffix is not kept."""
        nodes = self.nodes
        if new is not None:
            done = nodes.bind_run(keys, new, old)
            keys = keys[done:]  # from a hash bound elsewhere, which stays there
        nodes.repoint(keys, old, new)

    def note_freed(self, node: Node) -> None:
        self.freed.append(node)
        self.freed_entries += len(node.packed)

    def release(self, node: Node) -> int:
        """Pop a freed node's entries; returns the hashes looked up."""
        self.nodes.repoint(node.packed, node, None)
        self.freed_entries -= len(node.packed)
        return len(node.packed)

    def live(self) -> int:
        """Entries at most of nodes not freed."""
        return len(self.nodes) - self.freed_entries


def unbind(lookup: dict[int, Node], node: Node) -> int:
    """Pop the entries of a worker's own lookup that bind `node`'s hashes to it, in C loops; a hash bound elsewhere
    since stays there. Returns the entries popped."""
    keys = node.packed
    popped = list(map(lookup.pop, keys, repeat(None)))
    mine = popped.count(node)
    if mine + popped.count(None) != len(keys):
        for h, other in zip(keys, popped, strict=True):
            if other is not None and other is not node:
                lookup[h] = other
    return mine
