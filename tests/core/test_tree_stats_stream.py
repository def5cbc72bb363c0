"""`DumpStats`: a dump read as a stream gives the figures of its whole replay (`tree_diff.tree_stats`), while it
keeps no more than three levels of the tree's nodes, and of their blocks only the local hashes of those two
workers or more hold; a dump in an order it cannot follow says so (`NotStreamable`), never a wrong figure."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.core.events import RouterEvent, Stored
from kvctl.core.names import WorkerKey
from kvctl.core.tree_diff import index_content, tree_stats
from kvctl.core.tree_stats import DumpStats, NotStreamable
from tests.core.test_tree_diff import FIXTURE, Path, as_stream, contents


def level_widths(dump: list[RouterEvent]) -> list[int]:
    """Nodes per level of a dump (parents before children)."""
    level_of: dict[tuple[WorkerKey, int], int] = {}
    nodes: dict[int, set[tuple[int | None, int]]] = {}
    for event in dump:
        data = event.data
        assert type(data) is Stored
        level = 1 if data.parent_hash is None else level_of[(event.worker, data.parent_hash)] + 1
        nodes.setdefault(level, set()).add((data.parent_hash, data.block_hashes[0]))
        level_of.update(((event.worker, h), level) for h in data.block_hashes)
    return [len(nodes[level]) for level in sorted(nodes)]


def figures(stats: DumpStats) -> dict[str, Any]:
    return {**stats.counts(), **stats.shape()}


def assert_same_figures(streamed: dict[str, Any], replayed: dict[str, Any]) -> None:
    """Equal, but for the order of shared prefixes tied in holders, depth and local hash (a replay ranks those
    by its own walk; only the alphabet of three local hashes of these tests makes them common)."""
    def rank(prefix: dict[str, Any]) -> tuple[int, int, int]:
        return -prefix["holders"], -prefix["depth"], prefix["local_hash"]

    assert [rank(p) for p in streamed["shared_prefixes"]] == [rank(p) for p in replayed["shared_prefixes"]]
    assert {**streamed, "shared_prefixes": None} == {**replayed, "shared_prefixes": None}


@settings(max_examples=200, deadline=None)
@given(contents, st.randoms(use_true_random=False), st.integers(0, 4) | st.just(100))
def test_a_streamed_dump_gives_its_replays_figures_keeping_three_levels_of_nodes(
        content: dict[WorkerKey, list[Path]], rng: random.Random, top: int) -> None:
    content_of = index_content(as_stream(content, 1, rng))
    dump = content_of.index.dump()
    widths = level_widths(dump)
    three_levels = max(sum(widths[i:i + 3]) for i in range(len(widths)))
    shared = sum(1 for holders in index_content(dump).holders().values() if len(holders) >= 2)
    stats = DumpStats(top=top)
    for event in dump:
        stats.add(event)
        nodes, local_hashes = stats.retained()
        assert nodes <= three_levels and local_hashes <= shared, (stats.retained(), widths, shared)
    replayed = tree_stats(dump, top=top)
    # `nodes` are the dump's own (a replay may merge an edge into its only child): as the router counts its own
    replayed["nodes"] = replayed["tiers"]["device"]["nodes"] = sum(widths)
    streamed = figures(stats)
    assert_same_figures(streamed, replayed)
    if top == 100:  # all of them: the same prefixes, named the same
        assert sorted(map(str, streamed["shared_prefixes"])) == sorted(map(str, replayed["shared_prefixes"]))


@settings(max_examples=200, deadline=None)
@given(contents, st.randoms(use_true_random=False))
def test_a_dump_in_another_order_gives_the_same_figures_or_says_it_cannot(content: dict[WorkerKey, list[Path]],
                                                                         rng: random.Random) -> None:
    dump = index_content(as_stream(content, 1, rng)).index.dump()
    rng.shuffle(dump)
    stats = DumpStats(top=3)
    try:
        stats.add_all(dump)
        streamed = figures(stats)
    except NotStreamable:
        return
    replayed = tree_stats(dump, top=3)
    assert_same_figures({**streamed, "nodes": 0, "tiers": 0}, {**replayed, "nodes": 0, "tiers": 0})


def test_dynamos_own_dump_streams_to_its_replays_figures() -> None:
    """Dynamo 1.6.1's indexer lists a node's holders together, partial ones too, level by level, as kvctl does."""
    stats = DumpStats(top=5)
    stats.add_all(FIXTURE)
    assert figures(stats) == tree_stats(FIXTURE, top=5)
    assert figures(stats)["shared_prefixes"]


def test_depth_first_is_not_followed() -> None:
    """A child's depth needs its parent's: a dump that closes a level and comes back to it is replayed whole."""
    root, child, grandchild, late = (RouterEvent(1, d) for d in (
        _stored(None, 1), _stored(1, 2), _stored(2, 3), _stored(None, 4)))
    stats = DumpStats()
    with pytest.raises(NotStreamable, match="breadth-first"):
        stats.add_all([root, child, grandchild, late, RouterEvent(1, _stored(4, 5))])


def _stored(parent: int | None, block: int) -> Stored:
    return Stored(parent, [block], [block * 7])
