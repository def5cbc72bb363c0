"""The router's collector: each object walked once, young; what survives is out of later walks."""

from __future__ import annotations

import gc
import weakref

from kvctl.runtime import ROUTER_GEN0_THRESHOLD, survivors_frozen


class _Node:
    __slots__ = ("children", "parent", "__weakref__")

    def __init__(self, parent: _Node | None) -> None:
        self.parent = parent
        self.children: list[_Node] = []


def _tracked_ids() -> set[int]:
    return {id(o) for o in gc.get_objects()}


def test_a_burst_of_survivors_never_piles_up_in_the_generations_a_collection_walks() -> None:
    with survivors_frozen():
        burst = [_Node(None) for _ in range(20 * ROUTER_GEN0_THRESHOLD)]
        walked_next = len(gc.get_objects())
        alive = _tracked_ids()
        assert walked_next < 2 * ROUTER_GEN0_THRESHOLD
        assert sum(id(n) in alive for n in burst) < ROUTER_GEN0_THRESHOLD
        gc.collect(0)
        alive = _tracked_ids()
        assert not any(id(n) in alive for n in burst)


def test_a_cycle_that_dies_young_is_still_collected() -> None:
    with survivors_frozen():
        parent = _Node(None)
        parent.children.append(_Node(parent))
        gone = weakref.ref(parent)
        del parent
        gc.collect(0)
        assert gone() is None


def test_the_collector_is_as_it_was_afterwards() -> None:
    threshold, frozen, callbacks = gc.get_threshold(), gc.get_freeze_count(), list(gc.callbacks)
    with survivors_frozen():
        kept = _Node(None)
        gc.collect(0)
        assert gc.get_threshold()[0] == ROUTER_GEN0_THRESHOLD
        assert id(kept) not in _tracked_ids()
    assert gc.get_threshold() == threshold
    assert gc.callbacks == callbacks
    assert gc.get_freeze_count() == frozen
    assert id(kept) in _tracked_ids()
