"""`GET /v1/tree/stats?shape=true`: the shape figures of `kvctl tree stats`, computed where the index is.

A client computing them reads the whole dump (167 s and 10.7 GB at 10M pairs); here the router walks its
own index (`KvIndex.capture_in_slices`) into `core.tree_stats.EdgeStats`, a node at a time, and lets the loop
run whenever a slice of `SLICE_S` is spent, so routes and events wait at most about a slice behind it,
however large the index. Memory: two levels of nodes. An index with slower tiers goes block by block into
`TieredStats` instead (their blocks join the device's paths), keeping all of it until the end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

from kvctl.core.index import KvIndex
from kvctl.core.index.kv_index import DumpEdge, events_of
from kvctl.core.tree_stats import EdgeStats, TieredStats
from kvctl.server.budget import SLICE_S

WALK_NODES = 16
"""Tree nodes and their edges taken between two looks at the clock (`KvIndex.capture_in_slices`): well under a slice."""


async def index_shape(index: KvIndex, *, top: int) -> dict[str, Any]:
    """`paths`, `depths` and `shared_prefixes` of `index`, as `kvctl tree stats` shows them."""
    stats: EdgeStats | TieredStats
    if index.lower:  # the slower tiers' blocks join the device's paths: block by block, all kept
        stats = dump = TieredStats(top=top)

        def feed(edges: list[DumpEdge]) -> None:
            dump.add_all(events_of(edges))
    else:
        stats = nodes = EdgeStats(top=top)
        feed = nodes.add
    started = time.perf_counter()
    for _ in _steps(index, feed, stats):
        if time.perf_counter() - started >= SLICE_S:
            await asyncio.sleep(0)
            started = time.perf_counter()
    return stats.shape()


def _steps(index: KvIndex, feed: Callable[[list[DumpEdge]], None], stats: EdgeStats | TieredStats) -> Iterator[None]:
    """The walk, `WALK_NODES` at a time, then the closing of the last levels: the loop may run after each."""
    for edges in index.capture_in_slices(WALK_NODES):
        feed(edges)
        yield
    yield from stats.finish()
