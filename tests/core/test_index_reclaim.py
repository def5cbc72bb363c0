"""What `RadixTree.remove` leaves for later: freed nodes' lookup entries, given back by `reclaim`.

The sizes a router reports must be exact at every moment, whatever is still waiting; the waiting work
must be found and done by `reclaim` in slices of the size asked; and a router that never goes idle
must still keep its lookups within a quarter more than their size.
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


def test_removed_requests_leave_entries_that_reclaim_gives_back_in_slices() -> None:
    tree = RadixTree()
    evictions = [request(tree, W, n) for n in range(50)]
    for hashes in evictions[:40]:
        assert tree.remove(W, hashes).status is Status.ok
    assert (tree.size(W), tree.blocks, tree.nodes) == (10 * 64, 10 * 64, 10)
    assert tree.debt == 40 * 63  # each request's first hash is popped by the removal itself
    assert_lookups_consistent(tree)
    slices = 0
    while tree.reclaim(128):
        slices += 1
        assert_lookups_consistent(tree)
        assert tree.size(W) == 10 * 64
    assert slices == 40 * 64 // 128 - 1
    assert tree.debt == 0
    assert len(tree._lookup[tree._slots[W]]) == 10 * 64
    assert tree.remove(W, evictions[0]).missing == 64  # what was given back stays gone


def test_a_worker_that_lets_go_of_everything_hands_its_whole_lookup_over() -> None:
    tree = RadixTree()
    evictions = [request(tree, W, n) for n in range(20)]
    request(tree, OTHER, 99)
    for hashes in evictions:
        tree.remove(W, hashes)
    slot = tree._slots[W]
    assert tree._lookup[slot] == {} and tree.size(W) == 0
    assert tree.debt == 20 * 63
    assert tree.reclaim(20 * 63 - 1) is True
    assert tree.reclaim(1) is False
    assert tree.debt == 0
    assert tree.size(OTHER) == 64


@pytest.mark.parametrize("slack", [0, 1024])
def test_a_lookup_that_is_never_reclaimed_grows_by_a_quarter_at_most(monkeypatch: pytest.MonkeyPatch,
                                                                        slack: int) -> None:
    """Steady churn (a request in, the oldest out) with no idle moment: dead entries are popped by
    `remove` itself once the lookup has grown by a quarter, and the sizes stay exact throughout."""
    monkeypatch.setattr(removal, "_DEAD_SLACK", slack)
    tree = RadixTree()
    live = [request(tree, W, n) for n in range(30)]
    base = len(tree._lookup[tree._slots[W]])
    largest = 0
    for n in range(30, 1000):
        live.append(request(tree, W, n))
        assert tree.remove(W, live.pop(0)).status is Status.ok
        largest = max(largest, len(tree._lookup[tree._slots[W]]))
        assert tree.size(W) == 30 * 64
    assert_lookups_consistent(tree)
    assert largest <= base + base // 4 + slack + 2 * 64
    assert tree.debt > 0  # churn alone never pays all of it: that is left to reclaim
