"""`path_of_sequence`'s bound: a branch point with more children than the walk's budget stops it, and it says so."""

from __future__ import annotations

from kvctl.core.events import Removed, RouterEvent, Stored
from kvctl.core.hashing import sequence_hashes
from kvctl.core.index import KvIndex
from kvctl.core.index.branch_seqs import WIDE
from kvctl.core.index.sequence_path import path_of_sequence


def index_with_branches(branches: int) -> KvIndex:
    """One shared block, then `branches` prompts of one more block each, stored by one worker."""
    index = KvIndex()
    index.apply(RouterEvent(1, Stored(None, [1], [100])))
    for b in range(branches):
        index.apply(RouterEvent(1, Stored(1, [1000 + b], [200 + b])))
    return index


def test_a_branch_point_within_the_budget_is_walked() -> None:
    index = index_with_branches(8)
    path = path_of_sequence(index.device, sequence_hashes([100, 207, 999]), budget=8)
    assert (path.local_hashes, path.exhausted) == ([100, 207], False)


def test_a_branch_point_past_the_budget_stops_the_walk_and_says_so() -> None:
    index = index_with_branches(8)
    path = path_of_sequence(index.device, sequence_hashes([100, 207]), budget=7)
    assert (path.local_hashes, path.exhausted) == ([100], True)


def test_a_sequence_that_leaves_the_tree_mid_edge_stops_there() -> None:
    index = KvIndex()
    index.apply(RouterEvent(1, Stored(None, [1, 2, 3], [100, 101, 102])))
    assert index.path_of_sequence(sequence_hashes([100, 101, 555])).local_hashes == [100, 101]
    assert index.path_of_sequence(sequence_hashes([555, 101])).local_hashes == []
    assert index.path_of_sequence([]).local_hashes == []


def test_a_wide_branch_point_is_hashed_once_then_kept_as_the_tree_changes() -> None:
    """A branch point of `WIDE` children or more keeps its map: a later walk past it hashes none of them, and sees
    a child adopted, let go, or moved by a split since."""
    index = KvIndex()
    index.apply(RouterEvent(1, Stored(None, [1, 2], [100, 101])))  # a two-block prompt, branching after its end
    for b in range(WIDE):
        index.apply(RouterEvent(1, Stored(2, [1000 + b], [200 + b])))
    tree = index.device
    assert path_of_sequence(tree, sequence_hashes([100, 101, 207]), budget=WIDE).local_hashes == [100, 101, 207]
    assert path_of_sequence(tree, sequence_hashes([100, 101, 215]), budget=0).local_hashes == [100, 101, 215]
    index.apply(RouterEvent(1, Stored(2, [5000], [900])))  # adopted
    assert path_of_sequence(tree, sequence_hashes([100, 101, 900]), budget=0).local_hashes == [100, 101, 900]
    index.apply(RouterEvent(1, Removed([1003])))  # let go
    assert path_of_sequence(tree, sequence_hashes([100, 101, 203]), budget=0).local_hashes == [100, 101]
    index.apply(RouterEvent(2, Stored(None, [1, 6], [100, 777])))  # splits the prompt: its suffix takes the branch
    assert path_of_sequence(tree, sequence_hashes([100, 101, 209]), budget=2).local_hashes == [100, 101, 209]
    assert path_of_sequence(tree, sequence_hashes([100, 777]), budget=2).local_hashes == [100, 777]
    assert tree.branches.entries == WIDE  # WIDE children, one adopted and one let go
