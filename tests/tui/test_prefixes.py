"""The tree view's prefixes from a dump, read through the index's public walk of its edges."""

from __future__ import annotations

from kvctl.core.events import Removed, RouterEvent, Stored
from kvctl.tui.prefixes import Prefix, shared_prefixes


def _stored(worker: int, blocks: list[int], *, parent: int | None = None, dp_rank: int = 0) -> RouterEvent:
    return RouterEvent(worker, Stored(parent, blocks, blocks), dp_rank=dp_rank)


def test_a_fork_is_a_shared_step_then_one_step_per_branch() -> None:
    events = [_stored(1, [1, 2, 3]), _stored(2, [1, 2, 4]), _stored(3, [9], dp_rank=1)]
    assert shared_prefixes(events) == (
        Prefix(2, 2, ("1:0", "2:0"), 0, (Prefix(1, 3, ("1:0",), 0, (), 0), Prefix(1, 3, ("2:0",), 0, (), 0)), 0),
        Prefix(1, 1, ("3:1",), 0, (), 0),
    )
    assert shared_prefixes(events, levels=1)[0].children == ()
    assert shared_prefixes(events, width=1)[0].more == 1


def test_workers_holding_only_the_first_blocks_of_a_step_are_counted_apart() -> None:
    events = [_stored(w, [1, 2, 3, 4]) for w in (1, 2, 3)]
    events += [_stored(3, [5, 6], parent=4), RouterEvent(2, Removed([4]))]  # 1 holds 4 blocks of 6, 2 holds 3
    assert shared_prefixes(events) == (Prefix(6, 6, ("3:0",), 2, (), 0),)
