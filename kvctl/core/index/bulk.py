"""An index as flat runs of nodes, and an empty index built back from them in bulk: a restart's image (issue 27).

Replaying an image as one Stored event per (edge, holder) decodes and walks a node once per holder, through the
general `store`; a run instead lists each node once, in breadth-first order (a parent before its children): its
parent's place in the list, its edge's engine and local hashes, the mask of workers that hold it whole and the
workers that hold a prefix of it. `Builder` creates each node with all its holders at once and fills the
workers' lookups a node at a time, in C.

The runs hold exactly what `KvIndex.capture` holds (`runs_of` reads one), and `Builder` builds what replaying
that capture's events builds (`events_of_runs`): where the two could differ (an engine hash at two places of a
worker's lookup, two siblings under one local hash) the builder says so, and its caller replays the events.
A node's held length is that of its longest holder; those holding that much hold it whole, as a replay makes them.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from kvctl.core.events import Stored, Tier
from kvctl.core.index.kv_index import DumpEdge, KvIndex
from kvctl.core.index.node import Node, iter_bits
from kvctl.core.index.radix import RadixTree
from kvctl.core.names import WorkerKey

# (Block, holder) pairs a run holds at most (besides one node's): a restore builds a run between two yields to its
# loop, and a pair costs about 0.6 us (a lookup entry), so a run holds the loop about `budget.SLICE_S`
RUN_PAIRS = 4096


@dataclass(slots=True)
class TreeRun:
    """Nodes of the device tree, `first` the place of the first in the whole list."""

    first: int
    parents: array[int] = field(default_factory=lambda: array("q"))  # each node's parent's place; -1: the root
    lengths: array[int] = field(default_factory=lambda: array("I"))  # blocks on each node's edge
    hashes: array[int] = field(default_factory=lambda: array("Q"))  # engine hashes, edge after edge
    locals: array[int] = field(default_factory=lambda: array("Q"))  # local (token) hashes, likewise
    full: list[int] = field(default_factory=list)  # per node: the workers (bits of `Runs.workers`) holding it whole
    cut_nodes: array[int] = field(default_factory=lambda: array("I"))  # places of nodes held in part
    cut_slots: array[int] = field(default_factory=lambda: array("I"))  # by which worker
    cut_lengths: array[int] = field(default_factory=lambda: array("I"))  # how many of its first blocks


@dataclass(slots=True)
class LowerRun:
    """Blocks of a slower tier, one (worker, parent hash, block hash, local hash) each: as a dump holds them."""

    tier: Tier
    slots: array[int] = field(default_factory=lambda: array("I"))  # the worker (`Runs.workers`)
    parents: list[int | None] = field(default_factory=list)
    blocks: array[int] = field(default_factory=lambda: array("Q"))
    locals: array[int] = field(default_factory=lambda: array("Q"))


@dataclass(slots=True)
class Runs:
    """One model's index as runs: `workers` numbers the holders, those of the device tree first."""

    workers: list[WorkerKey]
    device_workers: int
    runs: list[TreeRun | LowerRun]


def runs_of(edges: Sequence[DumpEdge], max_pairs: int = RUN_PAIRS) -> Runs:
    """A capture's edges (`KvIndex.capture`: a node's holders one after another, parents first) as runs."""
    device = dict.fromkeys(e.worker for e in edges if e.tier is Tier.device)
    workers = {w: n for n, w in enumerate([*device, *(w for w in dict.fromkeys(e.worker for e in edges)
                                                      if w not in device)])}
    runs: list[TreeRun | LowerRun] = []
    places: dict[int, int] = {}  # id(a node's hashes) -> its place
    run = TreeRun(0)
    at = pairs = 0  # pairs: held in `run` so far
    while at < len(edges) and edges[at].tier is Tier.device:
        node = edges[at].block_hashes
        end = at + 1
        while end < len(edges) and edges[end].block_hashes is node:
            end += 1
        held = [(workers[e.worker], e.length) for e in edges[at:end]]
        length = max(k for _, k in held)
        weight = sum(k for _, k in held)
        if run.lengths and pairs + weight > max_pairs:
            runs.append(run)
            run, pairs = TreeRun(run.first + len(run.lengths)), 0
        pairs += weight
        parent = edges[at].parent_edge
        places[id(node)] = place = run.first + len(run.lengths)
        run.parents.append(-1 if parent is None else places[id(parent)])
        run.lengths.append(length)
        run.hashes.extend(node[:length])
        run.locals.extend(edges[at].tokens_hashes[:length])
        run.full.append(sum(1 << s for s, k in held if k == length))
        for s, k in held:
            if k < length:
                run.cut_nodes.append(place)
                run.cut_slots.append(s)
                run.cut_lengths.append(k)
        at = end
    if run.lengths:
        runs.append(run)
    lower: LowerRun | None = None
    for e in edges[at:]:
        if lower is None or lower.tier is not e.tier or len(lower.blocks) >= max_pairs:
            lower = LowerRun(e.tier)
            runs.append(lower)
        lower.slots.append(workers[e.worker])
        lower.parents.append(e.parent_hash)
        lower.blocks.append(e.block_hashes[0])
        lower.locals.append(e.tokens_hashes[0])
    return Runs(list(workers), len(device), runs)


def events_of_runs(runs: Runs) -> Iterator[tuple[WorkerKey, Stored]]:
    """The Stored events replaying `runs` (what the capture they were read from gives, a node's full holders
    before those of a prefix): the way to build an index from them where `Builder` cannot."""
    workers = runs.workers
    last: list[int] = []  # each node's last engine hash
    for run in runs.runs:
        if isinstance(run, LowerRun):
            for s, parent, block, local in zip(run.slots, run.parents, run.blocks, run.locals, strict=True):
                yield workers[s], Stored(parent, [block], array("Q", [local]), run.tier)
            continue
        cuts: dict[int, list[tuple[int, int]]] = {}
        for n, s, k in zip(run.cut_nodes, run.cut_slots, run.cut_lengths, strict=True):
            cuts.setdefault(n, []).append((s, k))
        at = 0
        for n, (p, length, full) in enumerate(zip(run.parents, run.lengths, run.full, strict=True), run.first):
            hashes, locs = run.hashes[at:at + length].tolist(), run.locals[at:at + length]
            parent = None if p < 0 else last[p]
            for s, k in [(s, length) for s in iter_bits(full)] + cuts.get(n, []):
                yield workers[s], Stored(parent, hashes[:k], locs[:k])
            last.append(hashes[-1])
            at += length


class Builder:
    """Builds an empty index from runs, one `add` at a time; False from `add` or `finish`: it could not build what
    a replay builds, and the caller replays `events_of_runs` into an index `reset` to empty instead."""

    def __init__(self, index: KvIndex, runs: Runs) -> None:
        self.index = index
        self.workers = runs.workers
        self.reset()
        tree = index.device
        for w in runs.workers[:runs.device_workers]:
            tree._slot(w)  # a fresh tree numbers them 0, 1, ...: the runs' masks are its masks
        self._nodes: list[Node] = []
        self._hashes = 0  # map entries the device tree must end with: every hash of every edge its own
        self._first: dict[int, int] = {}  # slot -> blocks of the nodes where it was the first holder

    def reset(self) -> None:
        """Empty the index in place: an approximate-mode router keeps a reference to its device tree."""
        RadixTree.__init__(self.index.device)
        self.index.lower = {}

    def add(self, run: TreeRun | LowerRun) -> bool:
        if isinstance(run, LowerRun):
            for s, parent_hash, block, local in zip(run.slots, run.parents, run.blocks, run.locals, strict=True):
                self.index._tier(run.tier).store(self.workers[s], parent_hash, (block,), (local,))
            return True
        tree = self.index.device
        root, nodes, shared, first = tree.root, self._nodes, tree._map.nodes, self._first
        held_nodes, count = tree._held_nodes, tree._count
        packed, locs = run.hashes, run.locals
        at = 0
        for p, length, full in zip(run.parents, run.lengths, run.full, strict=True):
            parent = root if p < 0 else nodes[p]
            end = at + length
            node = Node(locs[at:end], packed[at:end], parent, full, distinct=True)  # else `finish` fails
            key = locs[at]
            children = parent.children
            if children is None:
                parent.children = {key: node}
            elif key in children:  # a replay would walk into the sibling
                return False
            else:
                children[key] = node
            parent.internal = True
            if not full:  # a node nobody holds whole: not what a capture gives
                return False
            shared.fill(node.packed, node)
            held = iter_bits(full) if full & (full - 1) else [full.bit_length() - 1]  # most nodes: one holder
            for s in held:
                held_nodes[s].add(node)  # type: ignore[union-attr]
                count[s] += length
            first[held[0]] = first.get(held[0], 0) + length
            nodes.append(node)
            at = end
        for n, s, k in zip(run.cut_nodes, run.cut_slots, run.cut_lengths, strict=True):
            node = nodes[n]
            if node.cutoffs is None:
                node.cutoffs = {}
            node.cutoffs[s] = k
            held_nodes[s].add(node)  # type: ignore[union-attr]
            count[s] += k
        tree.nodes += len(run.lengths)
        self._hashes += at
        return True

    def finish(self) -> bool:
        """True when every engine hash is at one place of the tree (none twice in an edge, none in two edges): then
        the tree is what a replay builds, and the workers' agreements are counted as a replay does."""
        tree = self.index.device
        if len(tree._map.nodes) != self._hashes:
            return False
        for worker, held in tree.sizes().items():
            agreed = held - self._first.get(tree._slots[worker], 0)
            if agreed:
                tree.hash_agreements[worker] = agreed
        return True


def build(index: KvIndex, runs: Runs) -> bool:
    """`Builder` in one go; False: it could not, and `index` holds what replaying the runs' events built."""
    builder = Builder(index, runs)
    if all(builder.add(run) for run in runs.runs) and builder.finish():
        return True
    builder.reset()
    for worker, event in events_of_runs(runs):
        index.apply_data(worker, event)
    return False


def pairs_of(runs: Iterable[TreeRun | LowerRun]) -> int:
    """(Edge, holder) pairs the runs hold: the events a replay of them applies."""
    total = 0
    for run in runs:
        if isinstance(run, LowerRun):
            total += len(run.blocks)
        else:
            total += sum(bin(m).count("1") for m in run.full) + len(run.cut_nodes)
    return total
