"""What a radix index holds, compared and summarised by content rather than by shape (`kvctl tree …`).

Two dumps of the same index can look nothing alike: one Stored of four blocks or four chained
Storeds, other event ids, other engine block hashes (each engine has its own), edges split at other
places, and the slower tiers' blocks in any order (Dynamo's `/dump` lists them one block an event, in
hash-map order, not parents first). What a query can match is the same, though: for each worker key and
tier, the set of block *paths*, a path being the local (tokens) hashes from the root down to the block.
So each side is replayed into a `KvIndex` (which also applies removals and clears, so a raw event stream
works as well as a dump), its dump is taken apart into edges, `(worker, tier, parent hash, block hash) ->
local hash`, and the edges are followed from the root, whatever order they came in, into paths interned
in a `PathTrie` that both sides share: equal content gives equal path ids, and a diff is set arithmetic.

Pure: no I/O; the commands turn these objects into tables, trees and JSON.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvctl.core.events import RouterEvent, Tier
from kvctl.core.hashing import sequence_hashes
from kvctl.core.index import KvIndex
from kvctl.core.index.kv_index import LOWER_TIERS
from kvctl.core.names import WorkerKey, format_worker

ROOT = 0
Block = tuple[Tier, int]
"""One block a worker holds: its tier and its path id in the shared trie."""


class PathTrie:
    """Block paths interned as small ints: a path is (its parent's id, its last local hash), the root is 0.

    Interning keeps a block's whole path in O(1) memory, whatever its depth, and makes path ids of
    two indexes comparable as long as both were walked into the same trie.
    """

    def __init__(self) -> None:
        self._ids: dict[tuple[int, int], int] = {}
        self.parents: list[int] = [ROOT]
        self.locals: list[int] = [0]
        self.depths: list[int] = [0]

    def child(self, parent: int, local_hash: int) -> int:
        key = (parent, local_hash)
        pid = self._ids.get(key)
        if pid is None:
            pid = self._ids[key] = len(self.parents)
            self.parents.append(parent)
            self.locals.append(local_hash)
            self.depths.append(self.depths[parent] + 1)
        return pid

    def path(self, pid: int) -> list[int]:
        """The local hashes from the root down to this block."""
        out: list[int] = []
        while pid != ROOT:
            out.append(self.locals[pid])
            pid = self.parents[pid]
        out.reverse()
        return out

    def describe(self, pid: int) -> dict[str, int]:
        """How a block is named to people and scripts: its depth, its local hash, and the sequence hash of
        its path (one u64 for the whole prefix, the value `kvctl hash` prints for the same tokens)."""
        return {"depth": self.depths[pid], "local_hash": self.locals[pid],
                "sequence_hash": sequence_hashes(self.path(pid))[-1]}


@dataclass
class IndexContent:
    """One index as block paths: what each worker key holds, and the index itself for its own statistics."""

    index: KvIndex
    trie: PathTrie
    held: dict[WorkerKey, set[Block]] = field(default_factory=dict)

    def holders(self) -> dict[int, dict[WorkerKey, set[Tier]]]:
        """Path id -> the workers holding that block, with the tiers each holds it on."""
        out: dict[int, dict[WorkerKey, set[Tier]]] = defaultdict(lambda: defaultdict(set))
        for worker, blocks in self.held.items():
            for tier, pid in blocks:
                out[pid][worker].add(tier)
        return out


def index_content(events: Iterable[RouterEvent], trie: PathTrie | None = None) -> IndexContent:
    """Replay `events` into a fresh index, then follow its edges into paths (of `trie`, shared to compare)."""
    index = KvIndex()
    index.load(events)
    content = IndexContent(index, trie if trie is not None else PathTrie())
    content.held = walk_edges(dump_edges(index), content.trie)
    return content


Edge = tuple[WorkerKey, Tier, int | None, int, int]
"""One block a worker holds, as a dump gives it: (worker, tier, parent engine hash or None, engine hash, local
hash). A dump's Stored of n blocks is n edges, each block the parent of the next."""

_TIERS = (Tier.device, *LOWER_TIERS)
_RANK = {tier: n for n, tier in enumerate(_TIERS)}
"""The order a query walks the tiers in (its device match, then each slower tier's continuation of it): a block
continues a path of its own tier or of a faster one. Kept in two bits beside a path id (`_walk_worker`)."""
assert len(_RANK) <= 4


def dump_edges(index: KvIndex) -> Iterator[Edge]:
    """The edges of every block `index`'s dump holds (`KvIndex.capture`), in no order that matters."""
    for edge in index.capture():
        worker, tier, parent = edge.worker, edge.tier, edge.parent_hash
        for block, local in zip(edge.block_hashes[:edge.length], edge.tokens_hashes[:edge.length], strict=True):
            yield worker, tier, parent, block, local
            parent = block


def walk_edges(edges: Iterable[Edge], trie: PathTrie) -> dict[WorkerKey, set[Block]]:
    """The blocks each worker holds, as (tier, path id), from its edges in any order: a set in, a set out.

    A block's path is its parent's plus its local hash; its parent is the block of the same worker with its
    parent hash, on its own tier or a faster one (a host block may continue a device path, as a query's
    match does, never the other way). The edges are followed from the root a level at a time, so a block is
    placed at the first level its parent hash is placed on a tier it may continue: where that hash has two
    paths there (a worker that stored one hash at two places), or none ever (its parent is gone), no query
    can follow it to one path, and it is left out, the same whatever order the edges came in.
    """
    by_worker: dict[WorkerKey, dict[int | None, _Children]] = defaultdict(dict)
    for worker, tier, parent, block, local in edges:
        waiting = by_worker[worker]
        child = (_RANK[tier], block, local)
        siblings = waiting.get(parent)
        if siblings is None:
            waiting[parent] = child  # one child a parent, mostly: no list for it
        elif isinstance(siblings, list):
            siblings.append(child)
        else:
            waiting[parent] = [siblings, child]
    held = {}
    for worker, waiting in by_worker.items():
        blocks = _walk_worker(waiting, trie)
        if blocks:
            held[worker] = blocks
    return held


_Child = tuple[int, int, int]
"""A block waiting for its parent: (its tier's rank, engine hash, local hash)."""
_Children = _Child | list[_Child]


def _walk_worker(waiting: dict[int | None, _Children], trie: PathTrie) -> set[Block]:
    """`walk_edges` of one worker: `waiting` is its blocks by parent hash (and is used up)."""
    held: set[Block] = set()
    placed: dict[int, int] = {}  # engine hash -> path id << 2 | the fastest tier's rank it is placed on there
    more: dict[int, list[int]] = {}  # the same for the other paths of a hash placed at two (rare)
    level: Iterable[int | None] = [None]
    while level:
        found: list[tuple[int, int, int]] = []  # (engine hash, tier rank, path id)
        for parent in level:  # decided on the levels before this one only: the order of `level` is moot
            children = waiting.pop(parent, None)
            if children is None:
                continue
            if parent is None:
                found.extend((block, rank, trie.child(ROOT, local))
                             for rank, block, local in (children if isinstance(children, list) else (children,)))
                continue
            codes = (placed[parent], *more[parent]) if parent in more else (placed[parent],)
            later = []
            for rank, block, local in (children if isinstance(children, list) else (children,)):
                under = {code >> 2 for code in codes if code & 3 <= rank}
                if len(under) == 1:
                    found.append((block, rank, trie.child(under.pop(), local)))
                elif not under:
                    later.append((rank, block, local))  # its parent hash may yet come on a faster tier
            if later:
                waiting[parent] = later
        after: dict[int, None] = {}  # each hash once
        for block, rank, pid in found:
            held.add((_TIERS[rank], pid))
            first = placed.get(block)
            if first is None or first >> 2 == pid and rank < first & 3:
                placed[block] = pid << 2 | rank
            elif first >> 2 != pid:
                more.setdefault(block, []).append(pid << 2 | rank)
            after[block] = None
        level = after
    return held


# ----- diff ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WorkerDiff:
    worker: WorkerKey
    blocks_a: int
    blocks_b: int
    only_a: frozenset[Block]
    only_b: frozenset[Block]


@dataclass(frozen=True)
class TreeDiff:
    """Per worker key, the blocks only one side holds; workers both sides agree on are listed with none."""

    trie: PathTrie
    workers: tuple[WorkerDiff, ...]

    @property
    def equal(self) -> bool:
        return not any(w.only_a or w.only_b for w in self.workers)

    def summary(self) -> list[dict[str, Any]]:
        return [{"worker": format_worker(w.worker), "worker_id": w.worker[0], "dp_rank": w.worker[1],
                 "blocks_a": w.blocks_a, "blocks_b": w.blocks_b, "only_a": len(w.only_a), "only_b": len(w.only_b)}
                for w in self.workers]

    def details(self, side: str, limit: int | None = None) -> list[dict[str, Any]]:
        """The blocks only side `a` (or `b`) holds, by worker, tier, depth: the first `limit` of them."""
        rows: list[dict[str, Any]] = []
        for w in self.workers:
            blocks = w.only_a if side == "a" else w.only_b
            for tier, pid in sorted(blocks, key=lambda b: (b[0].value, self.trie.depths[b[1]], self.trie.locals[b[1]])):
                if limit is not None and len(rows) >= limit:
                    return rows
                rows.append({"side": side, "worker": format_worker(w.worker), "worker_id": w.worker[0],
                             "dp_rank": w.worker[1], "tier": tier.value, **self.trie.describe(pid)})
        return rows

    def to_dict(self, limit: int | None = None) -> dict[str, Any]:
        """The JSON object: `equal`, the per-worker counts, and up to `limit` differing blocks per side."""
        return {"equal": self.equal, "workers": self.summary(),
                "only_a": self.details("a", limit), "only_b": self.details("b", limit)}


def diff_events(a: Iterable[RouterEvent], b: Iterable[RouterEvent]) -> TreeDiff:
    trie = PathTrie()
    held_a, held_b = index_content(a, trie).held, index_content(b, trie).held
    workers = []
    for worker in sorted(held_a.keys() | held_b.keys()):
        blocks_a, blocks_b = held_a.get(worker, set()), held_b.get(worker, set())
        workers.append(WorkerDiff(worker, len(blocks_a), len(blocks_b),
                                  frozenset(blocks_a - blocks_b), frozenset(blocks_b - blocks_a)))
    return TreeDiff(trie, tuple(workers))


# ----- stats -----------------------------------------------------------------------------------------------

def tree_stats(events: Iterable[RouterEvent], *, top: int = 10) -> dict[str, Any]:
    """The router's `/v1/tree/stats` object for one model, plus what only the dump shows.

    `blocks`, `nodes` and `workers` are the device tier's (as the router reports them), `tiers` every
    tier's. Beyond those: `paths` (distinct blocks, all tiers), `depths` (a histogram in power-of-two
    buckets: distinct blocks and (worker, block) pairs at those depths) and `shared_prefixes` (the
    `top` deepest prefixes held by the most workers, each the last block before its holders thin out).
    """
    return content_stats(index_content(events), top=top)


def content_stats(content: IndexContent, *, top: int = 10) -> dict[str, Any]:
    tiers = content.index.stats()
    device = tiers[Tier.device]
    holders = content.holders()
    return {
        "blocks": device.blocks,
        "nodes": device.nodes,
        "workers": {format_worker(w): n for w, n in sorted(device.workers.items())},
        "tiers": {t.value: {"blocks": s.blocks, "nodes": s.nodes} for t, s in tiers.items()},
        "paths": len(holders),
        "depths": _depth_histogram(content.trie, holders),
        "shared_prefixes": _shared_prefixes(content.trie, holders, top),
    }


def _depth_histogram(trie: PathTrie, holders: dict[int, dict[WorkerKey, set[Tier]]]) -> list[dict[str, int]]:
    paths: Counter[int] = Counter()
    held: Counter[int] = Counter()
    for pid, workers in holders.items():
        bucket = trie.depths[pid].bit_length()  # depths 2^(k-1) .. 2^k - 1
        paths[bucket] += 1
        held[bucket] += sum(len(tiers) for tiers in workers.values())
    return [{"min": 1 << (k - 1), "max": (1 << k) - 1, "blocks": paths[k], "held": held[k]} for k in sorted(paths)]


def _shared_prefixes(trie: PathTrie, holders: dict[int, dict[WorkerKey, set[Tier]]], top: int) -> list[dict[str, Any]]:
    """Prefixes where sharing ends: held by 2+ workers, and every child of theirs by fewer of them.

    A worker holding a block holds its whole path, so holder counts only fall going down; these are
    the points where they fall, which a `top` of all prefixes would bury under their own ancestors.
    """
    best_child: dict[int, int] = {}
    for pid, workers in holders.items():
        parent = trie.parents[pid]
        best_child[parent] = max(best_child.get(parent, 0), len(workers))
    ends = [pid for pid, workers in holders.items() if len(workers) >= 2 and best_child.get(pid, 0) < len(workers)]
    ends.sort(key=lambda pid: (-len(holders[pid]), -trie.depths[pid], trie.locals[pid]))
    return [{**trie.describe(pid), "holders": len(holders[pid]),
             "workers": [format_worker(w) for w in sorted(holders[pid])]} for pid in ends[:top]]


# ----- outline (the `tree dump` view) ----------------------------------------------------------------------

@dataclass
class Segment:
    """A run of blocks drawn as one node: each block but the last has one child, held exactly as it is."""

    first: int  # path id of the first block
    last: int
    holders: dict[WorkerKey, frozenset[Tier]]
    children: list[Segment] = field(default_factory=list)
    hidden: int = 0  # child segments left out below the depth limit

    def blocks(self, trie: PathTrie) -> int:
        return trie.depths[self.last] - trie.depths[self.first] + 1


def outline(content: IndexContent, max_levels: int | None = None) -> list[Segment]:
    """The index as a tree of segments (chains of single-child blocks with the same holders collapsed),
    at most `max_levels` segments deep; ordered by holders (most first), then local hash."""
    holders = content.holders()
    children: dict[int, list[int]] = defaultdict(list)
    for pid in holders:
        children[content.trie.parents[pid]].append(pid)
    for kids in children.values():
        kids.sort(key=lambda pid: (-len(holders[pid]), content.trie.locals[pid]))

    def frozen(pid: int) -> dict[WorkerKey, frozenset[Tier]]:
        return {w: frozenset(tiers) for w, tiers in sorted(holders[pid].items())}

    def segment(first: int, level: int) -> Segment:
        seg = Segment(first, first, frozen(first))
        while len(children[seg.last]) == 1 and frozen(children[seg.last][0]) == seg.holders:
            seg.last = children[seg.last][0]
        below = children[seg.last]
        if max_levels is not None and level >= max_levels:
            seg.hidden = len(below)
        else:
            seg.children = [segment(pid, level + 1) for pid in below]
        return seg

    return [segment(pid, 1) for pid in children[ROOT]]
