"""`kvctl tree stats`' shape figures (distinct paths, depths, shared prefixes) from a dump read as a stream.

`tree_diff.tree_stats` replays a whole dump into an index, then interns every block path: memory grows with
the dump (10.7 GB at 10M pairs). A dump, though, comes parents before children and breadth first (a
kvctl router's and Dynamo's both walk their radix tree level by level, a node's holders one after another),
so once a node one level deeper than a node's children arrives, that node has seen all its holders and
children: its figures are final, and it is dropped. `EdgeStats` works a node at a time, keeping two levels
of nodes (a child's depth needs its parent's, which comes a whole level earlier), each without its blocks:
a router walks its own index into it (`server.tree_stats`), and `DumpStats` gathers a dump's events (a
file, a Dynamo indexer's `/dump`) into nodes for it. A router whose index has slower tiers (their blocks
come after the whole device tree and join its paths) goes block by block into `TieredStats`, all kept.

A dump this pass cannot follow (a removal, another tier's block, a parent not seen or already closed, a node
listed twice) raises `NotStreamable`: the caller replays it whole instead, as before. A router walking its
own index between events skips what changed under the walk.

Pure: no I/O.
"""

from __future__ import annotations

import heapq
from array import array
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


class TieredStats:
    """Add a router's dump events (device and slower tiers) in order, then read `shape()`. Block by block, and
    all of it kept until the end: the slower tiers' blocks (after the whole device tree) join the device's
    paths. What changed under the walk (a parent not seen) is skipped."""

    def __init__(self, *, top: int = 10) -> None:
        self._paths: dict[tuple[int, int], _Path] = {}
        self._chains: dict[tuple[WorkerKey, Tier], dict[int, _Path]] = {}  # engine hash -> path, per holder
        self._levels: dict[int, list[_Path]] = {}
        self._serial = count(1)
        self._tally = _Tally(top)

    def add_all(self, events: Iterable[RouterEvent]) -> None:
        for event in events:
            self.add(event)

    def add(self, event: RouterEvent) -> None:
        data = event.data
        worker = event.worker
        if type(data) is not Stored:
            return
        chain = self._chains.setdefault((worker, data.tier), {})
        parent = None if data.parent_hash is None else chain.get(data.parent_hash)
        if parent is None and data.parent_hash is not None:  # as `index_content` skips it
            return
        level = 1 if parent is None else parent.level + 1
        entries = self._levels.setdefault(level, [])
        bit, paths, serial = _TIER_BIT[data.tier], self._paths, self._serial
        parent_serial = 0 if parent is None else parent.serial
        for block_hash, local_hash in zip(data.block_hashes, data.tokens_hashes, strict=True):
            key = (parent_serial, local_hash)
            path = paths.get(key)
            if path is None:
                path = paths[key] = _Path(parent, local_hash, level, key, next(serial))
                entries.append(path)
            holders = path.holders
            holders[worker] = holders.get(worker, 0) | bit
            if parent is not None and len(holders) > parent.best_child:
                parent.best_child = len(holders)
            chain[block_hash] = path
            parent, parent_serial = path, path.serial

    def finish(self) -> Iterator[None]:
        """Close every path, a level at a time, pausing every `CLOSE_EVERY` blocks: a router runs its loop
        meanwhile. `shape` does it all at once when nobody did."""
        self._chains.clear()
        for level in sorted(self._levels):
            entries = self._levels.pop(level)
            for n, path in enumerate(entries, 1):
                self._finish(path)
                if n % CLOSE_EVERY == 0:
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

    def shape(self) -> dict[str, Any]:
        """`paths`, `depths` and `shared_prefixes`, as `tree_diff.content_stats` gives them; ends the pass."""
        for _ in self.finish():
            pass
        return self._tally.shape()


class DumpStats:
    """`tree stats` of a dump read as a stream (a file, a Dynamo indexer's `/dump`): its counts, and its shape
    through `EdgeStats`, a node at a time, in memory bounded by two levels of nodes.

    kvctl's dumps and Dynamo's both list each node's holders one after another (each a Stored of the node's
    blocks, or of a first part of them), level by level: consecutive events under one parent whose blocks
    agree are one node. A node keeps no block of its own but its last hash and depth (what its children
    need), and the local hashes only as far as two holders reach (what a shared prefix is named by), so a
    wide tree costs a few hundred bytes per node of its two widest levels, not per block.
    """

    def __init__(self, *, top: int = 10) -> None:
        self._nodes = EdgeStats(top=top, strict=True)
        self._group: list[DumpEdge] = []  # the holders of the node being read
        self._longest: DumpEdge | None = None
        self.blocks = 0  # (worker, block) pairs, as the events hold them
        self.nodes = 0
        self.workers: Counter[WorkerKey] = Counter()
        self._keys: dict[WorkerKey, WorkerKey] = {}  # one tuple per worker, whatever the nodes keeping it

    def add_all(self, events: Iterable[RouterEvent]) -> None:
        for event in events:
            self.add(event)

    def add(self, event: RouterEvent) -> None:
        data = event.data
        if type(data) is not Stored:
            raise NotStreamable(f"a {type(data).__name__.lower()} event: not a dump")
        if data.tier is not Tier.device:
            raise NotStreamable(f"a {data.tier.value} block: only device blocks stream in bounded memory")
        if not data.block_hashes:
            return
        n = len(data.block_hashes)
        worker = self._keys.setdefault(event.worker, event.worker)
        edge = DumpEdge(data.tier, worker, data.parent_hash, data.block_hashes, array("Q", data.tokens_hashes), n)
        longest = self._longest
        if longest is not None and not _same_node(longest, edge):
            self._flush()
            longest = None
        self._group.append(edge)
        if longest is None or n > longest.length:
            self._longest = edge
        self.blocks += n
        self.workers[worker] += n

    def _flush(self) -> None:
        if self._group:
            self.nodes += 1
            self._nodes.add_node(self._group)
            self._group, self._longest = [], None

    def shape(self) -> dict[str, Any]:
        """`paths`, `depths` and `shared_prefixes`, as `tree_diff.content_stats` gives them; ends the pass."""
        self._flush()
        return self._nodes.shape()

    def retained(self) -> tuple[int, int]:
        """Nodes this pass keeps now, and the local hashes kept with them: what its memory grows with."""
        return self._nodes.retained()

    def counts(self) -> dict[str, Any]:
        """What `/v1/tree/stats` gives for an index, counted from the dump's own events (a file has no index)."""
        self._flush()
        tiers = {Tier.device.value: {"blocks": self.blocks, "nodes": self.nodes}} if self.nodes else {}
        return {"blocks": self.blocks, "nodes": self.nodes,
                "workers": {format_worker(w): n for w, n in sorted(self.workers.items())}, "tiers": tiers}


def _same_node(longest: DumpEdge, edge: DumpEdge) -> bool:
    """Whether `edge` holds the node `longest` holds (both the same blocks under the same parent, as far as
    the shorter goes)."""
    n = min(longest.length, edge.length)
    return (edge.parent_hash == longest.parent_hash and edge.block_hashes[0] == longest.block_hashes[0]
            and edge.block_hashes[:n] == longest.block_hashes[:n]
            and edge.tokens_hashes[:n] == longest.tokens_hashes[:n])


_NO_LOCALS: array[int] = array("Q")
"""What a node one worker holds keeps of its local hashes (shared: never changed)."""


class _Node:
    """A radix node of a router's own tree, as its dump edges give it: the local hashes of its first `length`
    blocks, its parent node, and how many of its blocks each holder holds (all of them, or a first part)."""

    __slots__ = ("best_child", "depth", "holders", "key", "length", "level", "locals", "opened", "parent",
                 "serial", "tail_hash")

    def __init__(self, parent: _Node | None, edge: DumpEdge, holders: dict[WorkerKey, int], level: int,
                 serial: int, opened: int) -> None:
        self.parent: _Node | None = parent
        self.opened = opened  # parent's serial and first local hash: the node's name while its level is open
        # (worker, blocks held) pairs: a tuple, half a small dict's size (a wide level keeps many)
        self.holders, self.level, self.serial = tuple(holders.items()), level, serial
        lengths = sorted(holders.values())
        self.length = lengths[-1]
        # Named (shared prefixes, and the paths below them) only as far as two holders reach.
        self.locals = edge.tokens_hashes[:lengths[-2]] if len(lengths) > 1 else _NO_LOCALS
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

    def __init__(self, *, top: int = 10, strict: bool = False) -> None:
        self.strict = strict
        self._tally = _Tally(top)
        self._tails: dict[int, _Node] = {}  # a node's last engine hash -> the node, while children may come
        self._open: dict[int, _Node] = {}  # parent's serial and first local hash (`_Node.opened`) -> the node
        self._levels: dict[int, list[_Node]] = {}
        self._closing: deque[_Node] = deque()  # nodes of levels done, closed a few with each node added
        self._serial = count(1)
        self._deepest = 0

    def add(self, edges: Sequence[DumpEdge]) -> None:
        """One slice of the walk: whole nodes, each node's edges one after another."""
        start = 0
        for n in range(1, len(edges) + 1):
            if n == len(edges) or edges[n].block_hashes is not edges[start].block_hashes:
                self.add_node(edges[start:n])
                start = n

    def add_node(self, edges: Sequence[DumpEdge]) -> None:
        """One node: an edge per holder, each the node's blocks or a first part of them."""
        first = edges[0]
        parent = None if first.parent_hash is None else self._tails.get(first.parent_hash)
        if parent is None and first.parent_hash is not None:
            if self.strict:
                raise NotStreamable("a node under a block not seen (or already closed): not a breadth-first dump")
            return  # under a node cut since the walk reached it: what changed under the walk is skipped
        level = 1 if parent is None else parent.level + 1
        longest = max(edges, key=lambda e: e.length)
        opened = (0 if parent is None else parent.serial) << 64 | longest.tokens_hashes[0]
        if self.strict:
            self._check(parent, level, edges, opened, longest.block_hashes[longest.length - 1])
        if level > self._deepest:
            self._deepest = level
            for done in sorted(lv for lv in self._levels if lv < level - 1):
                self._closing.extend(self._levels.pop(done))
        for _ in range(min(2, len(self._closing))):  # twice what comes in: done before the next level is
            self._close(self._closing.popleft())
        holders: dict[WorkerKey, int] = {}
        for edge in edges:
            holders[edge.worker] = max(holders.get(edge.worker, 0), edge.length)
        node = _Node(parent, longest, holders, level, next(self._serial), opened)
        if parent is not None:
            parent.best_child = max(parent.best_child, len(holders))
        self._tails[node.key] = self._open[opened] = node
        self._levels.setdefault(level, []).append(node)

    def _check(self, parent: _Node | None, level: int, edges: Sequence[DumpEdge], opened: int,
               tail: int) -> None:
        """What a dump must be for its figures to come out as its replay's; else `NotStreamable`, and the
        caller replays it whole."""
        if level < self._deepest - 1:
            raise NotStreamable(f"a node of level {level} after level {self._deepest}: not a breadth-first dump")
        if parent is not None and any(dict(parent.holders).get(e.worker) != parent.length for e in edges):
            raise NotStreamable("a worker stores under a block it does not hold whole")
        if len({e.worker for e in edges}) < len(edges):
            raise NotStreamable("a worker listed twice as a holder of one node")
        if opened in self._open or tail in self._tails:
            raise NotStreamable("a node listed twice, or two nodes ending in one block hash")

    def _close(self, node: _Node) -> None:
        """Its blocks' figures: block i (from 1) is held by those holding at least i; sharing ends inside the
        node where a holder's part ends, and at its last block when no child keeps as many holders."""
        tally, above, lengths = self._tally, node.depth - node.length, sorted(n for _, n in node.holders)
        if self._tails.get(node.key) is node:
            del self._tails[node.key]
        if self._open.get(node.opened) is node:
            del self._open[node.opened]
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
                "workers": _names(w for w, n in node.holders if n >= blocks)}

    def retained(self) -> tuple[int, int]:
        """Nodes kept (their level or the next is still coming in), and the local hashes they keep."""
        return len(self._open), sum(len(node.locals) for node in self._open.values())

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
