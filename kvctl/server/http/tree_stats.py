"""`GET /v1/tree/stats?shape=true`: the shape figures of `kvctl tree stats`, computed where the index is.

A client computing them reads the whole dump (167 s and 10.7 GB at 10M pairs); here the router walks its
own device tree edge by edge (`core.index.shape.TreeShape`, into `core.tree_stats.IndexStats`), keeping runs
of blocks and only the edges two workers share, and lets the loop run whenever a slice of `SLICE_S` is spent,
so routes and events wait at most about a slice behind it, however large the index. An index with slower
tiers goes block by block into `TieredStats` instead (their blocks join the device's paths), keeping all of
it until the end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

from kvctl.core.index import KvIndex
from kvctl.core.index.kv_index import events_of
from kvctl.core.index.shape import TreeShape
from kvctl.core.tree_stats import IndexStats, TieredStats
from kvctl.server.budget import SLICE_S

WALK_NODES = 16
"""Tree nodes and their edges a dump's walk takes between two looks at the clock (`KvIndex.capture_in_slices`),
for an index with slower tiers: well under a slice."""

WALK_EDGES = 256
"""Edges (or runs, or shared edges) the device tree's own walk counts between two looks at the clock: ~0.1 ms."""


async def index_shape(index: KvIndex, *, top: int) -> dict[str, Any]:
    """`paths`, `depths` and `shared_prefixes` of `index`, as `kvctl tree stats` shows them."""
    stats: IndexStats | TieredStats
    if index.lower:  # the slower tiers' blocks join the device's paths: block by block, all kept
        stats = TieredStats(top=top)
        steps = _tiered_steps(index, stats)
    else:
        stats = IndexStats(TreeShape(index.device), top=top)
        steps = stats.steps(WALK_EDGES)
    started = time.perf_counter()
    for _ in steps:
        if time.perf_counter() - started >= SLICE_S:
            await asyncio.sleep(0)
            started = time.perf_counter()
    return stats.shape()


def _tiered_steps(index: KvIndex, stats: TieredStats) -> Iterator[None]:
    """The dump's walk, `WALK_NODES` at a time, then the closing of its paths: the loop may run after each."""
    for edges in index.capture_in_slices(WALK_NODES):
        stats.add_all(events_of(edges))
        yield
    yield from stats.finish()
