"""An internal check of `RadixTree`'s lookups, run after every step of the index's property tests.

A worker in the shared map (`RadixTree._map`) holds a hash where the map's node covers its place for the worker:
that is only right while the map binds every hash the worker holds to the node where it holds it, the worker's
node set names exactly the nodes carrying its bit, and its count is the sum of what it holds of them.

A worker with a lookup of its own keeps Dynamo's per-worker lookup. `remove` leaves the entries of a freed node
in it, counts them and lists the node for `reclaim`, instead of popping them one by one. Sizes and stats are
only right while that count is exact, and the count is only exact while the lookup of a worker that never
turned shadow names each block it holds once. That is checked wherever `remove` relies on it: not for a worker
hashing blocks differently from an edge's first holder (its own keys), nor for an edge holding one hash twice
(both fall back to popping).
"""

from __future__ import annotations

from kvctl.core.index import RadixTree
from kvctl.core.index.node import Node, positions_of


def _reachable(tree: RadixTree) -> list[Node]:
    out, stack = [], [tree.root]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend((node.children or {}).values())
    return out


def assert_lookups_consistent(tree: RadixTree) -> None:
    reachable = _reachable(tree)
    assert tree._mapped == sum(1 << s for s, held in enumerate(tree._held_nodes) if held is not None)
    for slot, lookup in enumerate(tree._lookup):
        deferred = tree._deferred[slot]
        held = tree._held_nodes[slot]
        if held is not None:
            assert lookup is None and slot not in tree._shadows, slot
            assert (deferred.dead, deferred.nodes) == (0, []), slot
            assert all(not n.freed and n.distinct and n.cutoff(slot) for n in held), slot
            assert {id(n) for n in reachable if n.cutoff(slot)} <= {id(n) for n in held}, slot
            assert tree._count[slot] == sum(n.cutoff(slot) for n in held), slot
            for node in held:
                for h in node.packed[: node.cutoff(slot)]:
                    assert tree._map.nodes.get(h) is node, (slot, h)
            continue
        if lookup is None or slot in tree._shadows:
            assert (deferred.dead, deferred.nodes) == (0, []), slot
            continue
        freed = [node for node in lookup.values() if node.freed]
        if tree.worker_of(slot) in tree.hash_mismatches:
            # its own keys for a freed edge stay, as in Dynamo's lookup (which counts them): not let go lazily
            assert deferred.dead <= len(freed), (slot, deferred.dead, len(freed))
            continue
        assert deferred.dead == len(freed), (slot, deferred.dead, len(freed))
        assert {id(node) for node in freed} <= {id(node) for node in deferred.nodes}, slot  # reclaim finds them
        for h, node in lookup.items():
            # an edge's index as read, without building it (which would hide a lazily built one's mistakes)
            index = node.index if node.index is not None else positions_of(node.packed)
            if not node.freed and len(index) == len(node.packed):
                pos = index.get(h)
                assert pos is not None and node.covers(slot, pos), (slot, h)
    assert tree._map.freed_entries == sum(len(n.packed) for n in tree._map.freed)
