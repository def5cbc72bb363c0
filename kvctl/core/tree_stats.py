"""`kvctl tree stats`' shape figures (distinct paths, depths, shared prefixes) from a dump read as a stream.

`tree_diff.tree_stats` replays a whole dump into an index, then interns every block path: memory grows with
the dump (10.7 GB at 10M pairs). A dump, though, comes parents before children and breadth first (a
kvctl router's and Dynamo's both walk their radix tree level by level, a node's holders one after another),
so once a node one level deeper than a node's children arrives, that node has seen all its holders and
children: its figures are final, and it is dropped. `EdgeStats` works a node at a time, keeping two levels
of nodes (a child's depth needs its parent's, which comes a whole level earlier), each without its blocks:
`DumpStats` gathers a dump's events (a file, a Dynamo indexer's `/dump`) into nodes for it. A router needs
no dump of its own tree: `IndexStats` counts it from the runs and shared edges `core.index.shape` walks,
which is what the same tree's dump would give. A router whose index has slower tiers (their blocks come
after the whole device tree and join its paths) goes block by block into `TieredStats`, all kept.

A dump this pass cannot follow (a removal, another tier's block, a parent not seen or already closed, a node
listed twice) raises `NotStreamable`: the caller replays it whole instead, as before.

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

from kvctl.core import native
from kvctl.core.events import RouterEvent, Stored, Tier
from kvctl.core.hashing import sequence_hashes
from kvctl.core.index.kv_index import DumpEdge
from kvctl.core.index.shape import TreeShape
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
        self._nodes = EdgeStats(top=top)
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
        edge = DumpEdge(data.tier, worker, data.parent_hash, array("Q", data.block_hashes),
                        array("Q", data.tokens_hashes), n)
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

    def __init__(self, parent: _Node | None, holders: dict[WorkerKey, int], local_hashes: array[int],
                 serial: int) -> None:
        self.parent: _Node | None = parent
        # (worker, blocks held) pairs: a tuple, half a small dict's size (a wide level keeps many)
        self.holders, self.serial = tuple(holders.items()), serial
        lengths = sorted(holders.values())
        self.length = lengths[-1]
        # Named (shared prefixes, and the paths below them) only as far as two holders reach.
        self.locals = local_hashes[:lengths[-2]] if len(lengths) > 1 else _NO_LOCALS
        self.depth: int = (0 if parent is None else parent.depth) + self.length  # of its last block
        self.tail_hash: int | None = None  # the sequence hash of its last block, once asked for
        self.best_child = 0
        self.key = self.opened = self.level = 0  # `EdgeStats`' own, while the node's level is open

    def sequence_hash(self, blocks: int) -> int:
        """The sequence hash of the path down to this node's block number `blocks` (from 1)."""
        prefix = [] if self.parent is None else [self.parent.tail()]
        return sequence_hashes([*prefix, *self.locals[:blocks]])[-1]

    def tail(self) -> int:
        if self.tail_hash is None:
            self.tail_hash = self.sequence_hash(self.length)
        return self.tail_hash


class EdgeStats:
    """`DumpStats`' figures, node by node (each node's holders together, as edges of its blocks). A node's
    blocks differ only in how many of its holders reach them, so they are counted at once: the cost grows
    with nodes and holders, not with (worker, block) pairs as a dump's replay does. Memory: two levels of
    nodes. What a dump must be for its figures to come out as its replay's is checked (`_check`): else
    `NotStreamable`."""

    def __init__(self, *, top: int = 10) -> None:
        self._tally = _Tally(top)
        self._tails: dict[int, _Node] = {}  # a node's last engine hash -> the node, while children may come
        self._open: dict[int, _Node] = {}  # parent's serial and first local hash (`_Node.opened`) -> the node
        self._levels: dict[int, list[_Node]] = {}
        self._closing: deque[_Node] = deque()  # nodes of levels done, closed a few with each node added
        self._serial = count(1)
        self._deepest = 0

    def add_node(self, edges: Sequence[DumpEdge]) -> None:
        """One node: an edge per holder, each the node's blocks or a first part of them."""
        first = edges[0]
        parent = None if first.parent_hash is None else self._tails.get(first.parent_hash)
        if parent is None and first.parent_hash is not None:
            raise NotStreamable("a node under a block not seen (or already closed): not a breadth-first dump")
        level = 1 if parent is None else parent.level + 1
        longest = max(edges, key=lambda e: e.length)
        opened = (0 if parent is None else parent.serial) << 64 | longest.tokens_hashes[0]
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
        node = _Node(parent, holders, longest.tokens_hashes, next(self._serial))
        # its name while its level is open (parent's serial and first local hash), the engine hash its children
        # name as their parent, its level
        node.opened, node.key, node.level = opened, longest.block_hashes[node.length - 1], level
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
        """Its blocks' figures, then it lets its parent go."""
        if self._tails.get(node.key) is node:
            del self._tails[node.key]
        if self._open.get(node.opened) is node:
            del self._open[node.opened]
        tally, above = self._tally, node.depth - node.length
        tally.distinct += node.length
        _count_run(tally.blocks, above, node.length)
        for _, n in node.holders:
            _count_run(tally.held, above, n)
        _offer_prefixes(tally, node)
        if sum(n == node.length for _, n in node.holders) >= 2:
            node.tail()  # while the parent is known: its children may be shared prefixes
        node.parent = None

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


def _offer_prefixes(tally: _Tally, node: _Node) -> None:
    """A node's shared prefixes: block i (from 1) is held by those holding at least i; sharing ends inside the
    node where a holder's part ends, and at its last block when no child keeps as many holders."""
    above, lengths = node.depth - node.length, sorted(n for _, n in node.holders)
    for i in sorted(set(lengths)):
        reaching = sum(n >= i for n in lengths)
        if reaching >= 2 and (i < node.length or node.best_child < reaching):
            tally.offer(reaching, above + i, node.locals[i - 1], node.serial << 32 | i,
                        partial(_describe, node, i, reaching))


def _count_run(counter: Counter[int], above: int, blocks: int, times: int = 1) -> None:
    """Count `times` each of the blocks at depths above+1 .. above+blocks, in their power-of-two depth buckets
    (2^(k-1) .. 2^k - 1)."""
    lo, end = above + 1, above + blocks
    while lo <= end:
        bucket = lo.bit_length()
        hi = min(end, (1 << bucket) - 1)
        counter[bucket] += (hi - lo + 1) * times
        lo = hi + 1


def _describe(node: _Node, blocks: int, reaching: int) -> dict[str, Any]:
    return {"depth": node.depth - node.length + blocks, "local_hash": node.locals[blocks - 1],
            "sequence_hash": node.sequence_hash(blocks), "holders": reaching,
            "workers": _names(w for w, n in node.holders if n >= blocks)}


class IndexStats:
    """`EdgeStats`' figures for a router's own device tree from its runs and shared edges (`TreeShape`), which
    cost a few attribute reads per node one worker holds: a tenth of a second at 10M pairs, not ten."""

    def __init__(self, tree: TreeShape, *, top: int = 10) -> None:
        self._tree, self._tally = tree, _Tally(top)
        self._done = False

    def steps(self, every: int) -> Iterator[None]:
        """The walk, then the figures, pausing after about `every` edges, holders or runs: a router runs its loop
        there."""
        yield from self._tree.steps(every)
        tally, tree = self._tally, self._tree
        counted = array("Q", native.u64_counts(tree.solo))  # in C, at once: ~3 ms at 10M pairs
        yield
        for n, (run, edges) in enumerate(zip(counted[::2], counted[1::2], strict=True), 1):  # one holder: all held
            above, blocks = run >> 32, run & 0xFFFF_FFFF
            tally.distinct += blocks * edges
            _count_run(tally.blocks, above, blocks, edges)
            _count_run(tally.held, above, blocks, edges)
            if n % every == 0:
                yield
        for n, ((above, blocks), edges) in enumerate(tree.blocks.items(), 1):
            tally.distinct += blocks * edges
            _count_run(tally.blocks, above, blocks, edges)
            if n % every == 0:
                yield
        for n, ((above, blocks), pairs) in enumerate(tree.held.items(), 1):
            _count_run(tally.held, above, blocks, pairs)
            if n % every == 0:
                yield
        nodes: dict[int, _Node] = {}  # id(SharedEdge) -> its node, for its children to name their path from
        budget = every
        for edge in tree.shared:
            parent = None if edge.parent is None else nodes[id(edge.parent)]
            node = nodes[id(edge)] = _Node(parent, dict(edge.holders), edge.locals, edge.serial)
            node.best_child = edge.best_child
            _offer_prefixes(tally, node)
            budget -= len(edge.holders)  # a prompt's edge may have a holder per worker
            if budget <= 0:
                yield
                budget = every
        self._done = True

    def shape(self) -> dict[str, Any]:
        """`paths`, `depths` and `shared_prefixes`, as `tree_diff.content_stats` gives them; ends the pass."""
        if not self._done:
            for _ in self.steps(CLOSE_EVERY):
                pass
        return self._tally.shape()
