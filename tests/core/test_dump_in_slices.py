"""A dump taken in slices (`KvIndex.capture_in_slices`), so that a server can apply events between them."""

from __future__ import annotations

import random

from kvctl.core.events import Cleared, RouterEvent, Stored, Tier
from kvctl.core.events.types import Removed
from kvctl.core.index import KvIndex, Status
from kvctl.core.index.kv_index import events_of


def _chains(rng: random.Random, index: KvIndex, n: int, first_hash: int) -> list[list[int]]:
    """`n` chains (a shared prefix of 4 blocks, then their own), each on 1-3 of 4 workers, a host copy of some."""
    chains = []
    for c in range(n):
        blocks = [1, 2, 3, 4] + [first_hash + c * 100 + k for k in range(rng.randrange(1, 8))]
        for worker in rng.sample(range(4), rng.randrange(1, 4)):
            index.apply(RouterEvent(worker, Stored(None, blocks, blocks)))
            if c % 5 == 0:
                index.apply(RouterEvent(worker, Stored(None, blocks[:2], blocks[:2], Tier.host_pinned)))
        chains.append(blocks)
    return chains


def test_slices_of_an_index_left_alone_are_its_capture() -> None:
    index = KvIndex()
    _chains(random.Random(1), index, 60, 1000)
    whole = index.capture()
    for nodes in (1, 7, 1000):
        parts = list(index.capture_in_slices(nodes))
        assert [e for part in parts for e in part] == whole
        assert len(parts) > 1 or nodes == 1000  # the loop is let go between them


def test_a_dump_of_an_index_changing_between_slices_replays_cleanly() -> None:
    """Stores, removals (cutting and freeing edges) and a worker's clear between slices: never an exception,
    and what the dump holds replays into a fresh index without one refused event."""
    for seed in range(20):
        rng = random.Random(seed)
        index = KvIndex()
        chains = _chains(rng, index, 40, 1000)
        edges = []
        for n, part in enumerate(index.capture_in_slices(3)):
            edges += part
            action = n % 3
            if action == 0:
                _chains(rng, index, 2, 100_000 + n * 1000)
            elif action == 1:
                chain = rng.choice(chains)
                for worker in range(4):
                    index.apply(RouterEvent(worker, Removed(chain[rng.randrange(2, len(chain)):])))
            else:
                index.apply(RouterEvent(rng.randrange(4), Cleared()))
        fresh = KvIndex()
        statuses = [fresh.apply(event).status for event in events_of(edges)]
        assert statuses == [Status.ok] * len(statuses), seed


def test_an_edge_cut_after_it_was_reached_still_gives_its_children_their_holders() -> None:
    index = KvIndex()
    for worker, leaf in ((0, 5), (1, 6)):
        index.apply(RouterEvent(worker, Stored(None, [1, 2, 3, 4, leaf], [1, 2, 3, 4, leaf])))
    slices = index.capture_in_slices(1)
    reached = next(slices) + next(slices)  # [1, 2, 3, 4] for both workers, then one leaf
    index.apply(RouterEvent(0, Stored(2, [7], [7])))  # cuts [1, 2, 3, 4] at 2: the other leaf's parent is new
    edges = reached + [e for part in slices for e in part]
    assert sorted((e.worker[0], e.block_hashes[:e.length][-1]) for e in edges) == [(0, 4), (0, 5), (1, 4), (1, 6)]


def test_a_slice_counts_the_edges_it_gives_not_only_the_nodes() -> None:
    """Nodes held by many workers give an edge each per holder: a slice of 64 such nodes held the loop for 64
    times the workers' edges (~35 ms at 1M pairs), so a slice ends once its nodes and edges reach its size."""
    index = KvIndex()
    for worker in range(32):
        index.load(RouterEvent(worker, Stored(None, [chain], [chain])) for chain in range(100))
    parts = list(index.capture_in_slices(64))
    assert [e for part in parts for e in part] == index.capture()
    assert max(len(part) for part in parts) <= 64 + 32  # past its size by one node's holders at most
