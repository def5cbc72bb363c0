"""The tree view's content: the prefixes most workers share, and who holds them, from a router's dump.

The dump is replayed into kvctl's own index, whose edges are already runs of blocks with one set of
holders: each edge is one prefix step, and the most widely held edges are listed first at every level.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvctl.core.events import RouterEvent
from kvctl.core.index import Edge, KvIndex, edges
from kvctl.core.names import format_worker
from kvctl.core.words import counted

WIDTH = 8
"""Prefixes kept per level: the tree view is for the few that matter, not for browsing the index."""

LEVELS = 6


@dataclass(frozen=True, slots=True)
class Prefix:
    blocks: int  # blocks on this step
    depth: int  # blocks from the root to the end of this step
    holders: tuple[str, ...]  # "ID:DP" of the workers holding the whole step
    partial: int  # workers holding only its first blocks
    children: tuple[Prefix, ...]
    more: int  # children left out (beyond WIDTH)


def shared_prefixes(events: Iterable[RouterEvent], *, width: int = WIDTH, levels: int = LEVELS) -> tuple[Prefix, ...]:
    """The device tier's top `width` prefixes at each of the first `levels` levels, most holders first."""
    index = KvIndex()
    index.load(events)
    return _steps(edges(index.device, levels=levels), 0, width)[0]


def _steps(below: tuple[Edge, ...], above: int, width: int) -> tuple[tuple[Prefix, ...], int]:
    found = []
    for edge in below:
        depth = above + edge.blocks
        children, more = _steps(edge.children, depth, width)
        holders = tuple(sorted(map(format_worker, edge.holders)))
        found.append(Prefix(edge.blocks, depth, holders, edge.partial, children, more))
    found.sort(key=lambda p: (-len(p.holders), -p.depth, p.holders))
    return tuple(found[:width]), max(0, len(found) - width)


def describe(prefix: Prefix) -> str:
    """One tree line: `+12 blocks (to 16) · 3 workers: 1:0, 2:0, 2:1`."""
    shown = ", ".join(prefix.holders[:6]) + (f", … +{len(prefix.holders) - 6}" if len(prefix.holders) > 6 else "")
    partly = f" (+{prefix.partial} partly)" if prefix.partial else ""
    return (f"+{counted(prefix.blocks, 'block')} (to {prefix.depth}) · {counted(len(prefix.holders), 'worker')}"
            f"{partly}: {shown or '-'}")
