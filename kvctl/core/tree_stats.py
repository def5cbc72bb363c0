"""`kvctl tree stats`' shape figures (distinct paths, depths, shared prefixes) from a dump read as a stream.

`tree_diff.tree_stats` replays a whole dump into an index, then interns every block path: memory grows with
the dump (10.7 GB at 10M pairs). A dump, though, comes parents before children and breadth first (a
kvctl router's and Dynamo's both walk their tree level by level), so once an edge one level deeper than a
block's children arrives, that block has seen all its holders and children: its figures are final, and it
is dropped. What is kept is two levels of the tree and the `top` shared prefixes, whatever the dump's
depth: a deep tree keeps a small part of it, a wide one (every request's tail under a few shared prompts)
most. The router runs the same pass over its own index, a slice at a time (`server.tree_stats`), so
`tree stats` against a router never downloads the dump.

A stream this pass cannot follow (a removal, a parent not seen or already dropped, another tier's block
while bounded) raises `NotStreamable` when `strict`: the caller replays it whole instead, as before. A router
walking its own index between events passes `strict=False`: what changed under the walk is skipped.

Pure: no I/O.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from itertools import count
from typing import Any

from kvctl.core.events import RouterEvent, Stored, Tier
from kvctl.core.hashing import sequence_hashes
from kvctl.core.index import Worker

CLOSE_EVERY = 256
"""Blocks closed between two pauses of `DumpStats.finish`: about a millisecond on a busy machine."""


class NotStreamable(ValueError):
    """The events are not a dump in an order this pass can follow in bounded memory."""


_TIER_BIT = {tier: 1 << n for n, tier in enumerate(Tier)}


class _Path:
    """One block path: its parent's path (until its own level is done), last local hash, depth, who holds it
    (a bit per tier, per worker), and once it is done and shared, the sequence hash of the whole path, so that
    no ancestor need be kept to name it. Only shared paths are named (shared prefixes), and a path held by one
    worker has no shared path below it: a worker holding a block holds its whole path."""

    __slots__ = ("best_child", "depth", "holders", "key", "level", "local", "parent", "sequence_hash", "serial")

    def __init__(self, parent: _Path | None, local: int, level: int, key: tuple[int, int], serial: int) -> None:
        self.parent: _Path | None = parent
        self.local, self.level, self.key, self.serial = local, level, key, serial
        self.depth: int = 1 if parent is None else parent.depth + 1
        self.sequence_hash: int | None = None
        self.holders: dict[Worker, int] = {}
        self.best_child = 0  # the most workers any child path has

    def named(self) -> int:
        """The sequence hash of the whole path, worked out (and kept) the first time it is asked for."""
        if self.sequence_hash is None:
            parent = self.parent
            self.sequence_hash = (self.local if parent is None
                                  else sequence_hashes([parent.named(), self.local])[1])
        return self.sequence_hash

    def describe(self) -> dict[str, int]:
        """As `PathTrie.describe`: depth, local hash, and the sequence hash of the whole path."""
        return {"depth": self.depth, "local_hash": self.local, "sequence_hash": self.named()}


class DumpStats:
    """Add a dump's events in order, then read `shape()` (and, for a file, `counts()`).

    `bounded`: drop each level once the level two below it starts; a router whose index has slower tiers
    (their blocks come after the whole device tree) keeps everything instead.
    """

    def __init__(self, *, top: int = 10, bounded: bool = True, strict: bool = True) -> None:
        self.top, self.bounded, self.strict = top, bounded, strict
        self._paths: dict[tuple[int, int], _Path] = {}
        self._chains: dict[tuple[Worker, Tier], dict[int, _Path]] = {}  # engine hash -> path, per holder
        self._levels: dict[int, list[tuple[_Path, dict[int, _Path], int]]] = {}  # level -> (path, chain, hash)
        self._closing: deque[list[tuple[_Path, dict[int, _Path], int]]] = deque()  # levels done, to close
        self._serial = count(1)
        self._deepest = 0
        self._depth_blocks: Counter[int] = Counter()
        self._depth_held: Counter[int] = Counter()
        self._distinct = 0
        self._shared: list[tuple[int, int, int, int, _Path]] = []  # min-heap: the weakest kept prefix first
        self.blocks: Counter[Tier] = Counter()  # (worker, block) pairs per tier, as the events hold them
        self.workers: Counter[Worker] = Counter()  # device pairs per worker
        self.nodes: Counter[Tier] = Counter()  # edges that start a path nobody started before

    def add_all(self, events: Iterable[RouterEvent]) -> None:
        for event in events:
            self.add(event)

    def add(self, event: RouterEvent) -> None:
        data = event.data
        worker = event.worker
        if type(data) is not Stored:
            return self._cannot(f"a {type(data).__name__.lower()} event: not a dump")
        if self.bounded and data.tier is not Tier.device:
            return self._cannot(f"a {data.tier.value} block: only device blocks stream in bounded memory")
        chain = self._chains.setdefault((worker, data.tier), {})
        parent = None if data.parent_hash is None else chain.get(data.parent_hash)
        if parent is None and data.parent_hash is not None:  # not streamable, or (as `index_content` skips
            # it) a worker that stored one hash at two places, whose later path cannot be followed
            return self._cannot(f"worker {worker[0]}:{worker[1]} stores under a block not seen (or dropped)")
        level = 1 if parent is None else parent.level + 1
        if self.bounded and level > self._deepest:
            self._deepest = level
            self._retire_below(level - 1)
        if self._closing:  # twice what comes in: the queue empties before the next level is done
            self._close_some(2 * len(data.block_hashes))
        tiers = self.blocks
        tiers[data.tier] += len(data.block_hashes)
        if data.tier is Tier.device:
            self.workers[worker] += len(data.block_hashes)
        entries = self._levels.setdefault(level, [])
        bit, paths, serial = _TIER_BIT[data.tier], self._paths, self._serial
        parent_serial = 0 if parent is None else parent.serial
        for n, (block_hash, local_hash) in enumerate(zip(data.block_hashes, data.tokens_hashes, strict=True)):
            key = (parent_serial, local_hash)
            path = paths.get(key)
            if path is None:
                path = paths[key] = _Path(parent, local_hash, level, key, next(serial))
                if n == 0:
                    self.nodes[data.tier] += 1
            holders = path.holders
            holders[worker] = holders.get(worker, 0) | bit
            if parent is not None and len(holders) > parent.best_child:
                parent.best_child = len(holders)
            chain[block_hash] = path
            entries.append((path, chain, block_hash))
            parent, parent_serial = path, path.serial

    def _cannot(self, why: str) -> None:
        if self.strict:
            raise NotStreamable(why)

    def _retire_below(self, level: int) -> None:
        """Every level under `level` is done (no later edge can reach it): queue its blocks to be closed."""
        for done in sorted(lv for lv in self._levels if lv < level):
            self._closing.append(self._levels.pop(done))

    def _close_some(self, budget: int) -> bool:
        """Close up to `budget` queued blocks: a little with each edge added, so that no edge pays for a
        whole level; True while some are left."""
        closing = self._closing
        while closing and budget > 0:
            entries = closing[0]
            while entries and budget > 0:
                path, chain, block_hash = entries.pop()
                budget -= 1
                chain.pop(block_hash, None)
                if self._paths.pop(path.key, None) is not None:
                    self._finish(path)
            if not entries:
                closing.popleft()
        return bool(closing)

    def finish(self) -> Iterator[None]:
        """Close every level, pausing every `CLOSE_EVERY` blocks: a router runs its loop meanwhile. `shape`
        does it all at once when nobody did."""
        self._retire_below(max(self._levels, default=0) + 1)
        while self._close_some(CLOSE_EVERY):
            yield

    def _finish(self, path: _Path) -> None:
        holders = len(path.holders)
        if holders >= 2:
            path.named()  # while its parent is known: then the ancestors can go
        path.parent = None
        self._distinct += 1
        bucket = path.depth.bit_length()  # depths 2^(k-1) .. 2^k - 1
        self._depth_blocks[bucket] += 1
        self._depth_held[bucket] += sum(bits.bit_count() for bits in path.holders.values())
        entry = (holders, path.depth, -path.local, -path.serial, path)  # ranked as `tree_diff._shared_prefixes`
        if holders >= 2 and path.best_child < holders and self.top:
            if len(self._shared) < self.top:
                heapq.heappush(self._shared, entry)
                return
            if entry[:4] > self._shared[0][:4]:
                heapq.heapreplace(self._shared, entry)
                return
        path.holders = {}  # alive a little longer only as the parent of paths whose level is not done

    def shape(self) -> dict[str, Any]:
        """`paths`, `depths` and `shared_prefixes`, as `tree_diff.content_stats` gives them; ends the pass."""
        for _ in self.finish():
            pass
        ranked = sorted(self._shared, key=lambda e: e[:4], reverse=True)
        return {
            "paths": self._distinct,
            "depths": [{"min": 1 << (k - 1), "max": (1 << k) - 1, "blocks": self._depth_blocks[k],
                        "held": self._depth_held[k]} for k in sorted(self._depth_blocks)],
            "shared_prefixes": [{**e[4].describe(), "holders": e[0],
                                 "workers": [f"{w[0]}:{w[1]}" for w in sorted(e[4].holders)]} for e in ranked],
        }

    def counts(self) -> dict[str, Any]:
        """What `/v1/tree/stats` gives for an index, counted from the dump's own edges (a file has no index)."""
        return {"blocks": self.blocks[Tier.device], "nodes": self.nodes[Tier.device],
                "workers": {f"{w[0]}:{w[1]}": n for w, n in sorted(self.workers.items())},
                "tiers": {t.value: {"blocks": self.blocks[t], "nodes": self.nodes[t]} for t in self.blocks}}
