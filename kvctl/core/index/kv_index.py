"""The index of one model: Dynamo's radix tree for the device tier, its continuation index for the others.

Routing scores come from the device tier, as in Dynamo; the slower tiers (CPU offload, disk, external
KV stores) say how far a worker's match continues beyond its device prefix, the blocks it could onboard
instead of recomputing (`LowerTier`, docs/contract.md): the tier credit of the cost function.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvctl.core.events import Cleared, EventData, Removed, RouterEvent, Stored, Tier
from kvctl.core.index.lower_tier import Continuation, LowerTier
from kvctl.core.index.radix import OK_EMPTY, ApplyResult, Matches, Node, RadixTree, iter_bits
from kvctl.core.index.sequence_path import Path, path_of_sequence
from kvctl.core.names import WorkerKey


@dataclass(slots=True)
class IndexMatches:
    scores: dict[WorkerKey, int] = field(default_factory=dict)  # device tier: Dynamo's overlap scores
    tree_sizes: dict[WorkerKey, int] = field(default_factory=dict)
    # Blocks each tier adds to a worker's match (device: its depth; a slower tier: its extension beyond the
    # faster ones). Empty when the model has no slower tier.
    by_tier: dict[Tier, dict[WorkerKey, int]] = field(default_factory=dict)


LOWER_TIERS = (Tier.host_pinned, Tier.disk, Tier.external)
"""The order a match continues in below the device (Dynamo's `lower_tier_query_order`)."""


class DumpEdge(NamedTuple):
    """One (edge, worker) of a dump: the first `length` blocks of an edge's (grow-only) arrays."""

    tier: Tier
    worker: WorkerKey
    parent_hash: int | None
    block_hashes: array[int]
    tokens_hashes: array[int]
    length: int
    parent_edge: array[int] | None = None  # the parent node's `packed` (by identity; None: the root): see `bulk`


def events_of(edges: Iterable[DumpEdge], first_id: int = 0) -> Iterator[RouterEvent]:
    """The dump's events, one Stored per edge, with the synthetic event ids `first_id`, +1, +2, ..."""
    for n, e in enumerate(edges, first_id):
        k = e.length
        yield RouterEvent(e.worker[0], Stored(e.parent_hash, e.block_hashes[:k].tolist(), e.tokens_hashes[:k].tolist(),
                                              e.tier), e.worker[1], n)


@dataclass(frozen=True, slots=True)
class TierStats:
    blocks: int
    nodes: int
    workers: dict[WorkerKey, int]


def _path_holders(parent: Node, root: Node, inherited: dict[int, tuple[Node, int]]) -> int:
    """The slots that hold every edge from the root to `parent`, included: as recorded when `parent` was
    reached, or, for a node that is new since (an edge cut between two slices of a dump), read up its path."""
    entry = inherited.get(id(parent))
    if entry is not None and entry[0] is parent:
        return entry[1]
    mask = -1
    node: Node | None = parent
    while node is not None and node is not root:
        mask &= node.full
        node = node.parent
    return mask


class KvIndex:
    def __init__(self) -> None:
        self.device = RadixTree()
        self.lower: dict[Tier, LowerTier] = {}

    def _tier(self, tier: Tier) -> RadixTree | LowerTier:
        if tier is Tier.device:
            return self.device
        index = self.lower.get(tier)
        if index is None:
            index = self.lower[tier] = LowerTier()
        return index

    def apply(self, event: RouterEvent) -> ApplyResult:
        return self.apply_data((event.worker_id, event.dp_rank), event.data)

    def apply_data(self, worker: WorkerKey, data: EventData) -> ApplyResult:
        """One event of `worker`'s, without the RouterEvent around it (engine batches come per worker)."""
        if type(data) is Stored:
            return self._tier(data.tier).store(worker, data.parent_hash, data.block_hashes, data.tokens_hashes)
        if type(data) is Removed:
            return self._tier(data.tier).remove(worker, data.block_hashes)
        assert type(data) is Cleared
        self.device.clear(worker)
        for tier in self.lower.values():
            tier.clear(worker)
        return OK_EMPTY

    def remove_worker(self, worker_id: int, dp_rank: int | None = None) -> int:
        return self.device.remove_worker(worker_id, dp_rank) + sum(
            tier.remove_worker(worker_id, dp_rank) for tier in self.lower.values())

    def find_matches(self, local_hashes: Sequence[int]) -> IndexMatches:
        device: Matches = self.device.find_matches(local_hashes)
        result = IndexMatches(scores=device.scores, tree_sizes=device.tree_sizes)
        if self.lower and len(local_hashes):
            result.by_tier[Tier.device] = device.scores
            last = self.device.path_hashes(local_hashes, set(device.scores.values()))
            at = {w: Continuation(d, last[d]) for w, d in device.scores.items()}
            for tier in LOWER_TIERS:
                index = self.lower.get(tier)
                if index is None:
                    continue
                for w in index.root_workers(local_hashes[0]):
                    at.setdefault(w, Continuation(0, None))
                after = index.extend(local_hashes, at)
                result.by_tier[tier] = {w: c.pos - at[w].pos for w, c in after.items() if c.pos > at[w].pos}
                at = after
        return result

    def path_of_sequence(self, sequence_hashes: Sequence[int]) -> Path:
        """The local hashes of the longest prefix of a request's sequence hashes the device tree holds."""
        return path_of_sequence(self.device, sequence_hashes)

    def workers(self) -> list[WorkerKey]:
        seen = dict.fromkeys(self.device.workers())
        for tier in self.lower.values():
            seen.update(dict.fromkeys(tier.workers()))
        return list(seen)

    def hash_mismatches(self) -> dict[WorkerKey, int]:
        """Per worker, device blocks stored on token paths indexed under other engine hashes.

        The slower tiers have none to report: their edges are keyed by engine hash, not by token path."""
        return dict(self.device.hash_mismatches)

    def hash_agreements(self) -> dict[WorkerKey, int]:
        """Per worker, device blocks stored on token paths indexed under the same engine hashes."""
        return dict(self.device.hash_agreements)

    @property
    def debt(self) -> int:
        """Freed lookup entries of the device tree not given back yet (`RadixTree.debt`)."""
        return self.device.debt

    def reclaim(self, budget: int) -> bool:
        """Give back up to `budget` freed lookup entries (`RadixTree.reclaim`); True while more is left."""
        return self.device.reclaim(budget)

    def stats(self) -> dict[Tier, TierStats]:
        """Per tier: (worker, block) pairs held, nodes (device) or continuation edges (slower tiers), per worker."""
        out = {Tier.device: TierStats(self.device.blocks, self.device.nodes, self.device.sizes())}
        for tier, index in self.lower.items():
            out[tier] = TierStats(index.blocks, index.nodes, index.sizes())
        return out

    def capture(self) -> list[DumpEdge]:
        """What a dump holds, taken in one step: the index may change as soon as this returns.

        O(edges), not O(blocks), for the device tree: each edge is kept by reference with its length
        (edges only grow in place, see `Node`), so a server can take it between two events and encode it
        at leisure. A slower tier gives one single-block edge per block held (its stores need no parent
        to be known, so any order replays). `events_of` turns it into the dump's events.
        """
        return [edge for part in self.capture_in_slices(None) for edge in part]

    def capture_in_slices(self, size: int | None) -> Iterator[list[DumpEdge]]:
        """`capture`, about `size` tree nodes and edges (or lower-tier blocks) at a time (None: all in one): a
        server can apply events between two slices instead of holding its loop for the whole walk (~0.5 s at
        2M blocks). Edges count as well as nodes: a node near the root may have a holder per worker, and a
        slice of 256 such nodes held ~35 ms of CPU at 1M blocks. A node's edges stay in one slice, so a slice
        may pass `size` by the holders of one node.

        Events applied between slices may or may not be in it, each edge as it was when reached: what
        was reached before is never changed (edges grow in place), a node cut since is followed to its new
        parts, one freed since has no holders left, and the workers an edge is given to are its holders then,
        among those that held its whole path when its parent was reached.
        """
        tree = self.device
        root = tree.root
        edges: list[DumpEdge] = []
        inherited: dict[int, tuple[Node, int]] = {}  # id(node) -> (node, slots that hold its whole path)
        work = 0  # nodes and edges in this slice so far
        for node, parent_hash in tree.walk():
            parent = node.parent
            allowed = -1 if parent is root or parent is None else _path_holders(parent, root, inherited)
            if node.children:
                inherited[id(node)] = (node, allowed & node.full)
            holders = [(s, len(node.packed)) for s in iter_bits(node.full & allowed)] if allowed else []
            parent_edge = None if parent is root or parent is None else parent.packed
            if node.cutoffs:
                holders.extend((s, c) for s, c in node.cutoffs.items() if allowed >> s & 1)
            for slot, k in holders:
                edges.append(DumpEdge(Tier.device, tree.worker_of(slot), parent_hash, node.packed, node.locals, k,
                                      parent_edge))
            work += 1 + len(holders)
            if size is not None and work >= size:
                yield edges
                edges, work = [], 0
        for tier, index in self.lower.items():
            for worker, parent_block, block, local in index.held_edges():
                edges.append(DumpEdge(tier, worker, parent_block, array("Q", (block,)), array("Q", (local,)), 1))
                if size is not None and len(edges) >= size:
                    yield edges
                    edges = []
        yield edges

    def dump(self) -> list[RouterEvent]:
        """Events that rebuild every block a query can reach, tier by tier, parents before children.

        Like Dynamo's own dump, one Stored per (edge, worker) with synthetic event ids. A worker's
        blocks under an edge it no longer holds whole cannot be matched by any query and could not
        be replayed (their parent is gone for it), so they are left out; `stats` still counts them.
        """
        return list(events_of(self.capture()))

    def load(self, events: Iterable[RouterEvent]) -> list[ApplyResult]:
        return [self.apply(event) for event in events]
