"""What the index costs per (worker, block) pair it holds, measured with tracemalloc on a workload of shared
prompts with unique tails (issue 27's scale workload, small): memory per pair at or below Dynamo's.

Engine hashes are made before measuring, as the router's decode process hands them over: what is
measured is the index's own structures (edges, the map, lookups), not the events' int objects, which it no longer
keeps (issue 40).
"""

from __future__ import annotations

import random
import tracemalloc
from array import array

import pytest

from kvctl.core import native
from kvctl.core.index import RadixTree, Status

WORKERS = 16
PROMPTS = 8


def stores(pairs: int) -> list[tuple[tuple[int, int], int | None, list[int], array[int]]]:
    rng = random.Random(27)
    prompts = [[rng.getrandbits(63) for _ in range(rng.randint(8, 64))] for _ in range(PROMPTS)]
    held: set[tuple[int, int]] = set()
    out: list[tuple[tuple[int, int], int | None, list[int], array[int]]] = []
    n = i = 0
    while n < pairs:
        w, p = i % WORKERS, rng.randrange(PROMPTS)
        i += 1
        tail = [rng.getrandbits(63) for _ in range(rng.randint(8, 64))]
        if (w, p) in held:
            parent, blocks = prompts[p][-1], tail
        else:
            held.add((w, p))
            parent, blocks = None, prompts[p] + tail
        n += len(blocks)
        out.append(((w, 0), parent, blocks, array("Q", blocks)))  # local hashes: the engine's, for brevity
    return out


def test_a_held_pair_costs_the_index_under_75_bytes() -> None:
    """~119 B while every edge kept an engine-hash -> place dict, ~88 B while edges kept their hashes' int objects
    and the map was a dict keyed by them; ~47-69 B (the map's table half full to three quarters) since issue 40.
    The pure-Python twin's map is a dict keyed by ints made from the packed edges: ~112 B."""
    todo = stores(100_000)
    tree = RadixTree()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for worker, parent, hashes, locals_ in todo:
            assert tree.store(worker, parent, hashes, locals_).status is Status.ok
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert used / tree.blocks < (75 if native.NATIVE else 120), f"{used / tree.blocks:.1f} B a pair"


@pytest.mark.parametrize("leaf_first", [True, False])
def test_evicting_a_whole_request_builds_no_edge_index(leaf_first: bool) -> None:
    """An engine evicts a request from its last block back (or from its first on): the run is taken with one
    compare of packed hashes, so the edge's hash -> place dict (~40 B a block) is not built just to be freed."""
    tree = RadixTree()
    hashes = list(range(1, 1025))
    assert tree.store((1, 0), None, hashes, array("Q", hashes)).status is Status.ok
    evicted = array("Q", reversed(hashes) if leaf_first else hashes)  # as the decode process hands it over
    tracemalloc.start()
    try:
        result = tree.remove((1, 0), evicted)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (result.status, result.blocks, tree.blocks) == (Status.ok, 1024, 0)
    assert peak < 24_000, f"{peak} B allocated to evict 1,024 blocks"  # the two 8 KB packed runs it compares
