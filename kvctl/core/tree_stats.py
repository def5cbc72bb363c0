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
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from itertools import count
from typing import Any

from kvctl.core.events import RouterEvent, Stored, Tier
from kvctl.core.hashing import sequence_hashes
from kvctl.core.index.kv_index import DumpEdge
from kvctl.core.names import WorkerKey, format_worker

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
        self.holders: dict[WorkerKey, int] = {}
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


def _names(holders: Iterable[WorkerKey]) -> list[str]:
    return [format_worker(w) for w in sorted(holders)]


class _Tally:
    """What both passes add up: distinct blocks, blocks and (worker, block, tier) holdings per power-of-two depth
    bucket, and the `top` shared prefixes, ranked as `tree_diff._shared_prefixes` ranks them."""

    def __init__(self, top: int) -> None:
        self.top = top
        self.distinct = 0
        self.blocks: Counter[int] = Counter()
        self.held: Counter[int] = Counter()
        self._shared: list[tuple[int, int, int, int, dict[str, Any]]] = []  # min-heap: the weakest kept first

    def offer(self, holders: int, depth: int, local: int, serial: int,
              describe: Callable[[], dict[str, Any]]) -> None:
        """A prefix where sharing ends; described only if it is kept."""
        entry = (holders, depth, -local, -serial)
        if not self.top or len(self._shared) >= self.top and entry <= self._shared[0][:4]:
            return
        kept = (*entry, describe())
        if len(self._shared) < self.top:
            heapq.heappush(self._shared, kept)
        else:
            heapq.heapreplace(self._shared, kept)

    def shape(self) -> dict[str, Any]:
        return {
            "paths": self.distinct,
            "depths": [{"min": 1 << (k - 1), "max": (1 << k) - 1, "blocks": self.blocks[k], "held": self.held[k]}
                       for k in sorted(self.blocks)],
            "shared_prefixes": [e[4] for e in sorted(self._shared, key=lambda e: e[:4], reverse=True)],
        }


class DumpStats:
    """Add a dump's events in order, then read `shape()` (and, for a file, `counts()`).

    `bounded`: drop each level once the level two below it starts; a router whose index has slower tiers
    (their blocks come after the whole device tree) keeps everything instead.
    """

    def __init__(self, *, top: int = 10, bounded: bool = True, strict: bool = True) -> None:
        self.bounded, self.strict = bounded, strict
        self._paths: dict[tuple[int, int], _Path] = {}
        self._chains: dict[tuple[WorkerKey, Tier], dict[int, _Path]] = {}  # engine hash -> path, per holder
        self._levels: dict[int, list[tuple[_Path, dict[int, _Path], int]]] = {}  # level -> (path, chain, hash)
        self._closing: deque[list[tuple[_Path, dict[int, _Path], int]]] = deque()  # levels done, to close
        self._serial = count(1)
        self._deepest = 0
        self._tally = _Tally(top)
        self.blocks: Counter[Tier] = Counter()  # (worker, block) pairs per tier, as the events hold them
        self.workers: Counter[WorkerKey] = Counter()  # device pairs per worker
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
        tally, holders = self._tally, len(path.holders)
        if holders >= 2:
            path.named()  # while its parent is known: then the ancestors can go
        path.parent = None
        tally.distinct += 1
        bucket = path.depth.bit_length()  # depths 2^(k-1) .. 2^k - 1
        tally.blocks[bucket] += 1
        tally.held[bucket] += sum(bits.bit_count() for bits in path.holders.values())
        if holders >= 2 and path.best_child < holders:
            tally.offer(holders, path.depth, path.local, path.serial,
                        lambda: {**path.describe(), "holders": holders, "workers": _names(path.holders)})
        path.holders = {}  # alive a little longer only as the parent of paths whose level is not done

    def shape(self) -> dict[str, Any]:
        """`paths`, `depths` and `shared_prefixes`, as `tree_diff.content_stats` gives them; ends the pass."""
        for _ in self.finish():
            pass
        return self._tally.shape()

    def counts(self) -> dict[str, Any]:
        """What `/v1/tree/stats` gives for an index, counted from the dump's own edges (a file has no index)."""
        return {"blocks": self.blocks[Tier.device], "nodes": self.nodes[Tier.device],
                "workers": {format_worker(w): n for w, n in sorted(self.workers.items())},
                "tiers": {t.value: {"blocks": self.blocks[t], "nodes": self.nodes[t]} for t in self.blocks}}


class _Node:
    """A radix node of a router's own tree, as its dump edges give it: the local hashes of its first `length`
    blocks, its parent node, and how many of its blocks each holder holds (all of them, or a first part)."""

    __slots__ = ("best_child", "depth", "holders", "key", "length", "level", "locals", "parent", "serial",
                 "tail_hash")

    def __init__(self, parent: _Node | None, edge: DumpEdge, holders: dict[WorkerKey, int], level: int,
                 serial: int) -> None:
        self.parent: _Node | None = parent
        self.locals, self.holders, self.level, self.serial = edge.tokens_hashes, holders, level, serial
        self.length = max(holders.values())
        self.key = edge.block_hashes[self.length - 1]  # the engine hash its children name as their parent
        self.depth: int = (0 if parent is None else parent.depth) + self.length  # of its last block
        self.tail_hash: int | None = None  # the sequence hash of its last block, once asked for
        self.best_child = 0

    def sequence_hash(self, blocks: int) -> int:
        """The sequence hash of the path down to this node's block number `blocks` (from 1)."""
        prefix = [] if self.parent is None else [self.parent.tail()]
        return sequence_hashes([*prefix, *self.locals[:blocks]])[-1]

    def tail(self) -> int:
        if self.tail_hash is None:
            self.tail_hash = self.sequence_hash(self.length)
        return self.tail_hash


class EdgeStats:
    """`DumpStats`' figures for a router's own device tree, read node by node from `KvIndex.capture_in_slices`
    (each node's holders come together, as edges sharing its arrays). A node's blocks differ only in how
    many of its holders reach them, so they are counted at once: the cost grows with nodes and holders, not
    with (worker, block) pairs as a dump's replay does. Memory: two levels of nodes, as `DumpStats`."""

    def __init__(self, *, top: int = 10) -> None:
        self._tally = _Tally(top)
        self._tails: dict[int, _Node] = {}  # a node's last engine hash -> the node, while children may come
        self._levels: dict[int, list[_Node]] = {}
        self._closing: deque[_Node] = deque()  # nodes of levels done, closed a few with each node added
        self._serial = count(1)
        self._deepest = 0

    def add(self, edges: Sequence[DumpEdge]) -> None:
        """One slice of the walk: whole nodes, each node's edges one after another."""
        start = 0
        for n in range(1, len(edges) + 1):
            if n == len(edges) or edges[n].block_hashes is not edges[start].block_hashes:
                self._node(edges[start:n])
                start = n

    def _node(self, edges: Sequence[DumpEdge]) -> None:
        first = edges[0]
        parent = None if first.parent_hash is None else self._tails.get(first.parent_hash)
        if parent is None and first.parent_hash is not None:
            return  # under a node cut since the walk reached it: what changed under the walk is skipped
        level = 1 if parent is None else parent.level + 1
        if level > self._deepest:
            self._deepest = level
            for done in sorted(lv for lv in self._levels if lv < level - 1):
                self._closing.extend(self._levels.pop(done))
        for _ in range(min(2, len(self._closing))):  # twice what comes in: done before the next level is
            self._close(self._closing.popleft())
        holders: dict[WorkerKey, int] = {}
        for edge in edges:
            holders[edge.worker] = max(holders.get(edge.worker, 0), edge.length)
        node = _Node(parent, first, holders, level, next(self._serial))
        if parent is not None:
            parent.best_child = max(parent.best_child, len(holders))
        self._tails[node.key] = node
        self._levels.setdefault(level, []).append(node)

    def _close(self, node: _Node) -> None:
        """Its blocks' figures: block i (from 1) is held by those holding at least i; sharing ends inside the
        node where a holder's part ends, and at its last block when no child keeps as many holders."""
        tally, above, lengths = self._tally, node.depth - node.length, sorted(node.holders.values())
        if self._tails.get(node.key) is node:
            del self._tails[node.key]
        tally.distinct += node.length
        lo = above + 1
        while lo <= node.depth:  # the depth buckets the node's blocks fall in: 2^(k-1) .. 2^k - 1
            bucket = lo.bit_length()
            hi = min(node.depth, (1 << bucket) - 1)
            tally.blocks[bucket] += hi - lo + 1
            tally.held[bucket] += sum(max(0, min(hi - above, n) - (lo - above) + 1) for n in lengths)
            lo = hi + 1
        for i in sorted(set(lengths)):
            reaching = sum(n >= i for n in lengths)
            if reaching >= 2 and (i < node.length or node.best_child < reaching):
                tally.offer(reaching, above + i, node.locals[i - 1], node.serial << 32 | i,
                            partial(self._describe, node, i, reaching))
        if lengths[-1:] and sum(n == node.length for n in lengths) >= 2:
            node.tail()  # while the parent is known: its children may be shared prefixes
        node.parent = None

    @staticmethod
    def _describe(node: _Node, blocks: int, reaching: int) -> dict[str, Any]:
        return {"depth": node.depth - node.length + blocks, "local_hash": node.locals[blocks - 1],
                "sequence_hash": node.sequence_hash(blocks), "holders": reaching,
                "workers": _names(w for w, n in node.holders.items() if n >= blocks)}

    def finish(self) -> Iterator[None]:
        """Close every node left, pausing every `CLOSE_EVERY // 16` of them (each costs about 16 blocks')."""
        for level in sorted(self._levels):
            self._closing.extend(self._levels.pop(level))
        while self._closing:
            for _ in range(min(CLOSE_EVERY // 16, len(self._closing))):
                self._close(self._closing.popleft())
            yield

    def shape(self) -> dict[str, Any]:
        for _ in self.finish():
            pass
        return self._tally.shape()
