"""An internal check of `RadixTree`'s lookups, run after every step of the index's property tests.

`remove` leaves the entries of a freed node in a worker's lookup, counts them and lists the node for
`reclaim`, instead of popping them one by one. Sizes and stats are only right while that count is
exact, and the count is only exact while the lookup of a worker that never turned shadow names each
block it holds once. That is checked wherever `remove` relies on it: not for a worker hashing blocks
differently from an edge's first holder (its own keys), nor for an edge holding one hash twice (both
fall back to popping).
"""

from __future__ import annotations

from kvctl.core.index import RadixTree
from kvctl.core.index.node import positions_of


def assert_lookups_consistent(tree: RadixTree) -> None:
    for slot, lookup in enumerate(tree._lookup):
        deferred = tree._deferred[slot]
        if lookup is None or slot in tree._shadows:
            assert (deferred.dead, deferred.nodes) == (0, []), slot
            continue
        freed = [node for node in lookup.values() if node.freed]
        assert deferred.dead == len(freed), (slot, deferred.dead, len(freed))
        assert {id(node) for node in freed} <= {id(node) for node in deferred.nodes}, slot  # reclaim finds them
        if tree.worker_of(slot) in tree.hash_mismatches:
            continue
        for h, node in lookup.items():
            # an edge's index as read, without building it (which would hide a lazily built one's mistakes)
            index = node.index if node.index is not None else positions_of(node.hashes)
            if not node.freed and len(index) == len(node.hashes):
                pos = index.get(h)
                assert pos is not None and node.covers(slot, pos), (slot, h)
