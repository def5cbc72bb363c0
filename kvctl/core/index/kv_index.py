"""The index of one model: one Dynamo-exact radix tree per storage tier.

Routing scores come from the device tier alone, as in Dynamo; the other tiers (CPU offload, disk,
external KV stores) are indexed the same way so kvctl can say how much of a prompt a worker could
onboard from them instead of recomputing it.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvctl.core.events import Cleared, EventData, Removed, RouterEvent, Stored, Tier
from kvctl.core.index.radix import OK_EMPTY, ApplyResult, Matches, RadixTree, Worker, iter_bits


@dataclass(slots=True)
class IndexMatches:
    scores: dict[Worker, int] = field(default_factory=dict)  # device tier: Dynamo's overlap scores
    tree_sizes: dict[Worker, int] = field(default_factory=dict)
    by_tier: dict[Tier, dict[Worker, int]] = field(default_factory=dict)  # matched depth per tier


class DumpEdge(NamedTuple):
    """One (edge, worker) of a dump: the first `length` blocks of an edge's (grow-only) arrays."""

    tier: Tier
    worker: Worker
    parent_hash: int | None
    block_hashes: list[int]
    tokens_hashes: array
    length: int


def events_of(edges: Iterable[DumpEdge]) -> Iterator[RouterEvent]:
    """The dump's events, one Stored per edge, with the synthetic event ids 0, 1, 2, ..."""
    for n, e in enumerate(edges):
        k = e.length
        yield RouterEvent(e.worker[0], Stored(e.parent_hash, e.block_hashes[:k], e.tokens_hashes[:k].tolist(),
                                              e.tier), e.worker[1], n)


@dataclass(frozen=True, slots=True)
class TierStats:
    blocks: int
    nodes: int
    workers: dict[Worker, int]


class KvIndex:
    def __init__(self) -> None:
        self.trees: dict[Tier, RadixTree] = {Tier.device: RadixTree()}

    def tree(self, tier: Tier) -> RadixTree:
        tree = self.trees.get(tier)
        if tree is None:
            tree = self.trees[tier] = RadixTree()
        return tree

    def apply(self, event: RouterEvent) -> ApplyResult:
        return self.apply_data((event.worker_id, event.dp_rank), event.data)

    def apply_data(self, worker: Worker, data: EventData) -> ApplyResult:
        """One event of `worker`'s, without the RouterEvent around it (engine batches come per worker)."""
        if type(data) is Stored:
            return self.tree(data.tier).store(worker, data.parent_hash, data.block_hashes, data.tokens_hashes)
        if type(data) is Removed:
            return self.tree(data.tier).remove(worker, data.block_hashes)
        assert type(data) is Cleared
        for tree in self.trees.values():
            tree.clear(worker)
        return OK_EMPTY

    def remove_worker(self, worker_id: int, dp_rank: int | None = None) -> int:
        return sum(tree.remove_worker(worker_id, dp_rank) for tree in self.trees.values())

    def find_matches(self, local_hashes: Sequence[int]) -> IndexMatches:
        device: Matches = self.trees[Tier.device].find_matches(local_hashes)
        result = IndexMatches(scores=device.scores, tree_sizes=device.tree_sizes)
        if len(self.trees) > 1:
            for tier, tree in self.trees.items():
                result.by_tier[tier] = device.scores if tier is Tier.device else tree.find_matches(
                    local_hashes).scores
        return result

    def workers(self) -> list[Worker]:
        seen: dict[Worker, None] = {}
        for tree in self.trees.values():
            seen.update(dict.fromkeys(tree.workers()))
        return list(seen)

    def hash_mismatches(self) -> dict[Worker, int]:
        """Per worker, blocks stored on token paths indexed under other engine hashes (every tier)."""
        total: dict[Worker, int] = {}
        for tree in self.trees.values():
            for worker, n in tree.hash_mismatches.items():
                total[worker] = total.get(worker, 0) + n
        return total

    @property
    def debt(self) -> int:
        """Freed lookup entries not given back yet, every tier (`RadixTree.debt`)."""
        return sum(tree.debt for tree in self.trees.values())

    def reclaim(self, budget: int) -> bool:
        """Give back up to `budget` freed lookup entries per tier (`RadixTree.reclaim`); True while more is left."""
        more = False
        for tree in self.trees.values():
            more = tree.reclaim(budget) or more
        return more

    def stats(self) -> dict[Tier, TierStats]:
        return {tier: TierStats(tree.blocks, tree.nodes, tree.sizes()) for tier, tree in self.trees.items()}

    def capture(self) -> list[DumpEdge]:
        """What a dump holds, taken in one step: the index may change as soon as this returns.

        O(edges), not O(blocks): each edge is kept by reference with its length (edges only grow in
        place, see `Node`), so a server can take it between two events and encode it at leisure.
        `events_of` turns it into the dump's events.
        """
        edges: list[DumpEdge] = []
        for tier, tree in self.trees.items():
            inherited: dict[int, int] = {}  # id(node) -> slots that hold its whole path
            everyone = -1
            for node, parent_hash in tree.walk():
                parent = node.parent
                allowed = everyone if parent is tree.root or parent is None else inherited.get(id(parent), 0)
                if node.children:
                    inherited[id(node)] = allowed & node.full
                holders = [(s, len(node.hashes)) for s in iter_bits(node.full & allowed)] if allowed else []
                if node.cutoffs:
                    holders.extend((s, c) for s, c in node.cutoffs.items() if allowed >> s & 1)
                for slot, k in holders:
                    edges.append(DumpEdge(tier, tree.worker_of(slot), parent_hash, node.hashes, node.locals, k))
        return edges

    def dump(self) -> list[RouterEvent]:
        """Events that rebuild every block a query can reach, tier by tier, parents before children.

        Like Dynamo's own dump, one Stored per (edge, worker) with synthetic event ids. A worker's
        blocks under an edge it no longer holds whole cannot be matched by any query and could not
        be replayed (their parent is gone for it), so they are left out; `stats` still counts them.
        """
        return list(events_of(self.capture()))

    def load(self, events: Iterable[RouterEvent]) -> list[ApplyResult]:
        return [self.apply(event) for event in events]
