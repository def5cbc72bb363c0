"""The shared hash map (issue 40) against per-worker lookups, its slow twin: Dynamo's own layout.

A worker's blocks live in the tree's one engine hash -> node map while the map can describe them; a worker it
cannot (a hash at two places, another worker's hash elsewhere, its own hashes for another's blocks) gets a lookup
of its own. `PerWorker` gives every worker its own lookup from its first store, as the index did before the map.
Fed the differential streams of `test_index_oracle` (every case of the index: siblings under one local hash,
removals of blocks others hold, middle removals, clears, worker removal, one hash at several places, workers
hashing alike or not), both must answer alike after every event: status, scores, tree sizes, stats and counters.
"""

from __future__ import annotations

import pytest

from kvctl.core.index import KvIndex, RadixTree
from kvctl.core.index.node import Node
from tests.core.index_checks import assert_lookups_consistent
from tests.core.test_index_oracle import (
    Op,
    generate,
    kvctl_event,
    per_worker_hash,
    tail_hash,
    uniform_hash,
)


class PerWorker(RadixTree):
    """The index with the map turned off: every worker keeps its own lookup."""

    def _share(self, keys: list[int], node: Node) -> bool:
        return False


def _apply(index: KvIndex, op: Op, event_id: int) -> object:
    if op[0] == "remove_worker":
        return index.remove_worker(op[1])
    return index.apply(kvctl_event(op, event_id))


def _view(index: KvIndex, queries: list[list[int]]) -> tuple[object, ...]:
    tree = index.device
    matches = [index.find_matches(q) for q in queries]
    return (tree.sizes(), tree.blocks, tree.nodes, tree.hash_mismatches, tree.hash_agreements,
            [(m.scores, m.tree_sizes) for m in matches], index.stats())


@pytest.mark.parametrize("hash_fn", [uniform_hash, per_worker_hash, tail_hash], ids=lambda f: f.__name__)
def test_the_map_answers_as_per_worker_lookups(hash_fn: object) -> None:
    mapped_holding = private_holding = 0  # (worker, event) pairs of the mapped index, in the map or not
    for seed in range(100):
        stream = generate(seed, hash_fn)  # type: ignore[arg-type]
        mapped, twin = KvIndex(), KvIndex()
        twin.device = PerWorker()
        for n, op in enumerate(stream.ops, 1):
            assert _apply(mapped, op, n) == _apply(twin, op, n), (seed, n, op)
            assert_lookups_consistent(mapped.device)
            assert_lookups_consistent(twin.device)
            assert _view(mapped, stream.queries[n - 1]) == _view(twin, stream.queries[n - 1]), (seed, n, op)
            tree = mapped.device
            for worker, slot in tree._slots.items():
                if tree.size(worker):
                    in_map = tree._held_nodes[slot] is not None
                    mapped_holding += in_map
                    private_holding += not in_map
            assert not any(twin.device._count), "the twin keeps no worker in the map"
    assert mapped_holding > 1000  # the map is what was compared
    if hash_fn is tail_hash:
        assert private_holding > 100  # and so were workers it cannot describe
