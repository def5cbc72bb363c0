"""A router's own `tree stats` figures (`TreeShape` walked into `IndexStats`) are those of its dump read as a
stream (`DumpStats`, node by node through `EdgeStats`: what the router answered from before, and what a dump
file still gives), for any index: stores, removals that cut edges in the middle, clears and worker removals."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvctl.core.events import Cleared, Removed, RouterEvent, Stored
from kvctl.core.index import KvIndex
from kvctl.core.index.shape import TreeShape
from kvctl.core.names import WorkerKey
from kvctl.core.tree_stats import DumpStats, IndexStats
from tests.core.test_index_model import ALPHABET, WORKER_IDS, WORKERS, Path, chain, engine_hash, stored

pytestmark = pytest.mark.usefixtures("native_impl")  # the walk's runs counted in C (`solo_split`), and by its twin

FEW = WORKERS[:3]  # three workers of two ids: they share most paths, and forgetting an id takes two of them
store = st.tuples(st.just("store"), st.sampled_from(FEW), st.integers(0, 40),
                  st.lists(st.sampled_from(ALPHABET[:2]), min_size=1, max_size=6))
remove = st.tuples(st.just("remove"), st.sampled_from(FEW), st.integers(0, 40),
                   st.lists(st.integers(0, 5), min_size=1, max_size=3))
clear = st.tuples(st.just("clear"), st.sampled_from(FEW))
forget = st.tuples(st.just("forget"), st.sampled_from(WORKER_IDS[:2]))
# stores first, so that there is a tree to cut; then anything, stores too
operations = st.builds(lambda built, then: built + then, st.lists(store, min_size=3, max_size=30),
                       st.lists(st.one_of(store, remove, remove, remove, clear, forget), max_size=20))


def apply(index: KvIndex, operations: list[tuple[Any, ...]],
          runs: dict[WorkerKey, list[list[Path]]] | None = None) -> None:
    """Stores at the root or under a block the worker stored before, removals of any blocks of a run the worker
    stored (from an edge's middle too: the edge is cut there, and the worker's blocks below it are no longer on
    its path), clears and worker removals. Refused events (a parent no longer held) are part of it."""
    runs = {} if runs is None else runs  # what each worker stored, for its later events to pick from
    for op in operations:
        if op[0] == "store":
            _, worker, pick, symbols = op
            mine = runs.setdefault(worker, [])
            parent: Path | None = mine[pick % len(mine)][pick % 7 % len(mine[pick % len(mine)])] if mine and pick % 3 \
                else None
            paths = chain(parent or (), symbols)
            index.apply(stored(worker, parent, paths))
            mine.append(paths)
        elif op[0] == "remove" and runs.get(op[1]):
            _, worker, pick, places = op
            run = runs[worker][pick % len(runs[worker])]
            index.apply(RouterEvent(worker[0], Removed([engine_hash(run[p % len(run)]) for p in places]), worker[1]))
        elif op[0] == "clear":
            index.apply(RouterEvent(op[1][0], Cleared(), op[1][1]))
        elif op[0] == "forget":
            index.remove_worker(op[1])


def of_its_dump(index: KvIndex, top: int) -> dict[str, Any]:
    stats = DumpStats(top=top)
    stats.add_all(index.dump())
    return stats.shape()


# Both workers hold the edge 3,2,3 and the edge 2,2 below it; the first then lets go of the second block of
# each: its 2,2 is no longer on a path it holds, so that edge is not shared (though both still hold a part).
CUT_ABOVE = [("store", FEW[0], 0, [3, 2, 3]), ("store", FEW[1], 0, [3, 2, 3]), ("store", FEW[0], 2, [2, 2]),
             ("store", FEW[1], 2, [2, 2]), ("store", FEW[0], 2, [3]),  # 3,2,3 cut from 2,2 by another child
             ("remove", FEW[0], 0, [1]), ("remove", FEW[0], 1, [1])]


@settings(max_examples=300, deadline=None)
@given(operations, st.sampled_from([0, 1, 3, 100]))
@example(CUT_ABOVE, 10)
def test_the_routers_walk_gives_what_its_dump_gives(ops: list[tuple[Any, ...]], top: int) -> None:
    index = KvIndex()
    apply(index, ops)
    walked = IndexStats(TreeShape(index.device), top=top)
    for _ in walked.steps(2):  # pausing, as a router does
        pass
    assert walked.shape() == of_its_dump(index, top)


@settings(max_examples=200, deadline=None)
@given(operations, operations)
def test_events_between_the_walks_slices_never_break_it(before: list[tuple[Any, ...]],
                                                        between: list[tuple[Any, ...]]) -> None:
    """A router applies events between two slices of the walk: edges cut, freed, extended, workers gone. Each
    edge is counted as it is when reached; nothing raises, and an index left alone after is counted right."""
    index, runs = KvIndex(), {}
    apply(index, before, runs)
    walked = IndexStats(TreeShape(index.device), top=3)
    for n, _ in enumerate(walked.steps(1)):
        apply(index, between[n:n + 1], runs)
    figures = walked.shape()
    assert figures["paths"] >= 0 and all(b["blocks"] <= b["held"] for b in figures["depths"])
    assert IndexStats(TreeShape(index.device), top=3).shape() == of_its_dump(index, 3)


def test_a_pause_comes_after_so_many_holders_not_only_so_many_edges() -> None:
    """A prompt's edge may have a holder per worker (and a child per request): pausing every 256 edges held the
    loop for 83 ms at 4M pairs, on the first 256 edges (the prompts, 64 holders each). Between two pauses the
    walk takes about `every` edges, holders and children: past it by one edge's at most."""
    index = KvIndex()
    for worker in range(32):
        for prompt in range(20):
            index.apply(RouterEvent(worker, Stored(None, [prompt + 1, 1000 * worker + prompt],
                                                   [prompt + 1, 1000 * worker + prompt])))
    shape = TreeShape(index.device)

    def counted() -> int:  # (edge, holder) pairs counted so far
        return sum(shape.held.values()) + len(shape.solo)

    done = [counted() for _ in shape.steps(64)] + [counted()]
    assert done[-1] == 20 * 32 + 20 * 32  # each prompt's 32 holders, and each worker's own tail
    taken = [b - a for a, b in zip([0, *done], done, strict=False)]
    assert max(taken) <= 64 + 32 + 32, taken  # its budget, past it by one prompt's holders and children at most
