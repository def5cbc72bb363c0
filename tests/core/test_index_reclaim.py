"""What `RadixTree.remove` leaves for later: freed nodes' entries in the shared hash map, given back by `reclaim`.

The sizes a router reports must be exact at every moment, whatever is still waiting; the waiting work
must be found and done by `reclaim` in slices of the size asked; and a router that never goes idle
must still keep its map within a quarter more than its live entries.
"""

from __future__ import annotations

import pytest

from kvctl.core.index import RadixTree, Status, removal
from tests.core.index_checks import assert_lookups_consistent

W = (1, 0)
OTHER = (2, 0)


def request(tree: RadixTree, worker: tuple[int, int], n: int, blocks: int = 64) -> list[int]:
    """Store request `n` of `blocks` blocks from the root; its hashes, as an engine would evict them."""
    hashes = [n * 1000 + k + 1 for k in range(blocks)]
    assert tree.store(worker, None, hashes, [n * 1000 + k + 1 for k in range(blocks)]).status is Status.ok
    return hashes[::-1]


def test_removed_requests_leave_entries_that_reclaim_gives_back_in_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(removal, "_DEAD_SLACK", 1 << 20)  # `remove` pops none itself
    tree = RadixTree()
    evictions = [request(tree, W, n) for n in range(50)]
    for hashes in evictions[:40]:
        assert tree.remove(W, hashes).status is Status.ok
    assert (tree.size(W), tree.blocks, tree.nodes) == (10 * 64, 10 * 64, 10)
    assert tree.debt == 40 * 64  # nothing is popped by the removal itself
    assert_lookups_consistent(tree)
    slices = 0
    while tree.reclaim(128):
        slices += 1
        assert_lookups_consistent(tree)
        assert tree.size(W) == 10 * 64
    assert slices == 40 * 64 // 128 - 1
    assert tree.debt == 0
    assert len(tree._map.nodes) == 10 * 64
    assert tree.remove(W, evictions[0]).missing == 64  # what was given back stays gone


def test_a_map_nobody_holds_anything_of_goes_to_reclaim_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(removal, "_DROP_AT_ONCE", 0)
    monkeypatch.setattr(removal, "_DEAD_SLACK", 1 << 20)
    tree = RadixTree()
    evictions = [request(tree, W, n) for n in range(20)]
    other = request(tree, OTHER, 99)
    for hashes in evictions:
        tree.remove(W, hashes)
    assert tree.size(W) == 0 and tree.debt == 20 * 64  # OTHER still holds a block: entries wait node by node
    tree.remove(OTHER, other)
    assert len(tree._map.nodes) == 0 and tree._map.freed == [] and tree.size(OTHER) == 0
    assert tree.debt == 21 * 64
    assert tree.reclaim(21 * 64 - 1) is True
    assert tree.reclaim(1) is False
    assert tree.debt == 0


def test_a_small_dead_map_is_let_go_at_once() -> None:
    tree = RadixTree()
    tree.remove(W, request(tree, W, 1))
    assert (len(tree._map.nodes), tree._garbage, tree.debt) == (0, [], 0)


@pytest.mark.parametrize("slack", [0, 1024])
def test_a_lookup_that_is_never_reclaimed_grows_by_a_quarter_at_most(monkeypatch: pytest.MonkeyPatch,
                                                                        slack: int) -> None:
    """Steady churn (a request in, the oldest out) with no idle moment: dead entries are popped by
    `remove` itself once the lookup has grown by a quarter, and the sizes stay exact throughout."""
    monkeypatch.setattr(removal, "_DEAD_SLACK", slack)
    tree = RadixTree()
    live = [request(tree, W, n) for n in range(30)]
    base = len(tree._map.nodes)
    largest = 0
    for n in range(30, 1000):
        live.append(request(tree, W, n))
        assert tree.remove(W, live.pop(0)).status is Status.ok
        largest = max(largest, len(tree._map.nodes))
        assert tree.size(W) == 30 * 64
    assert_lookups_consistent(tree)
    assert largest <= base + base // 4 + slack + 2 * 64
    assert tree.debt > 0  # churn alone never pays all of it: that is left to reclaim
