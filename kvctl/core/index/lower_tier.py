"""The index of one slower tier (host memory, disk, external): Dynamo 1.6.1's lower-tier continuation index.

Dynamo does not keep a radix tree for the tiers below the device: it keeps continuation edges in the
engine's hash space, `(parent engine hash, local hash) -> child engine hash`, each with the workers that
hold it, and asks a tier only how far a worker's match *continues* from where the faster tier left it
(docs/contract.md: blocks beyond the device prefix, then beyond the host prefix). So a host store whose parent
only the device tier holds is accepted here, where a tree would reject it, and it extends that worker's
device match. Behaviour kept from Dynamo's `LowerTierIndexer`:
- a store never fails: a block whose edge exists with another child hash, or whose engine hash the worker
  already holds under another edge, is skipped (the first mapping wins) and the walk goes on from it;
- a removal stops at the first hash the worker does not hold (the hashes after it stay);
- `Cleared` clears the event's (worker, dp_rank) only, as the device tier does (see `KvIndex.apply_data`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from kvctl.core.index.radix import OK_EMPTY, ApplyResult, Status
from kvctl.core.names import WorkerKey, selects

Key = tuple[int | None, int]
"""An edge: (parent engine hash, or None at the root; local hash of the block)."""


@dataclass(slots=True)
class _Edge:
    child: int
    owners: set[WorkerKey] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class Continuation:
    """Where a worker's match stands: `pos` blocks matched so far, the last one's engine hash (None: root)."""

    pos: int
    last_hash: int | None


class LowerTier:
    """Continuation edges of one tier of one model. Single writer; `extend` is read-only."""

    def __init__(self) -> None:
        self._edges: dict[Key, _Edge] = {}
        self._held: dict[WorkerKey, dict[int, Key]] = {}  # worker -> engine hash -> its edge

    def store(self, worker: WorkerKey, parent_hash: int | None, block_hashes: Sequence[int],
              tokens_hashes: Sequence[int]) -> ApplyResult:
        held = self._held.setdefault(worker, {})
        edges = self._edges
        parent = parent_hash
        stored = 0
        for block, local in zip(block_hashes, tokens_hashes, strict=True):
            key = (parent, local)
            parent = block
            if held.get(block, key) != key:
                continue
            edge = edges.get(key)
            if edge is None:
                edge = edges[key] = _Edge(block)
            elif edge.child != block:
                continue
            edge.owners.add(worker)
            held[block] = key
            stored += 1
        if not held:
            del self._held[worker]
        return ApplyResult(Status.ok, stored)

    def remove(self, worker: WorkerKey, block_hashes: Sequence[int]) -> ApplyResult:
        held = self._held.get(worker, {})
        removed = 0
        for block in block_hashes:
            key = held.pop(block, None)
            if key is None:
                break
            edge = self._edges[key]
            edge.owners.discard(worker)
            if not edge.owners:
                del self._edges[key]
            removed += 1
        if not held:
            self._held.pop(worker, None)
        if removed < len(block_hashes):
            return ApplyResult(Status.block_not_found, removed, len(block_hashes) - removed)
        return ApplyResult(Status.ok, removed)

    def clear(self, worker: WorkerKey) -> ApplyResult:
        for key in self._held.pop(worker, {}).values():
            edge = self._edges[key]
            edge.owners.discard(worker)
            if not edge.owners:
                del self._edges[key]
        return OK_EMPTY

    def remove_worker(self, worker_id: int, dp_rank: int | None = None) -> int:
        gone = [w for w in self._held if selects((worker_id, dp_rank), w)]
        blocks = sum(len(self._held[w]) for w in gone)
        for w in gone:
            self.clear(w)
        return blocks

    def root_workers(self, local_hash: int) -> set[WorkerKey]:
        edge = self._edges.get((None, local_hash))
        return set(edge.owners) if edge is not None else set()

    def extend(self, local_hashes: Sequence[int],
               start: Mapping[WorkerKey, Continuation]) -> dict[WorkerKey, Continuation]:
        """Every worker's continuation after walking this tier's edges it holds, from where `start` left it."""
        edges = self._edges
        n = len(local_hashes)
        out: dict[WorkerKey, Continuation] = {}
        for worker, at in start.items():
            pos, last = at.pos, at.last_hash
            while pos < n:
                edge = edges.get((last, local_hashes[pos]))
                if edge is None or worker not in edge.owners:
                    break
                last = edge.child
                pos += 1
            out[worker] = at if pos == at.pos else Continuation(pos, last)
        return out

    def workers(self) -> list[WorkerKey]:
        return list(self._held)

    def size(self, worker: WorkerKey) -> int:
        return len(self._held.get(worker, ()))

    def sizes(self) -> dict[WorkerKey, int]:
        return {w: len(held) for w, held in self._held.items()}

    @property
    def blocks(self) -> int:
        return sum(len(held) for held in self._held.values())

    @property
    def nodes(self) -> int:
        return len(self._edges)

    def held_edges(self) -> Iterator[tuple[WorkerKey, int | None, int, int]]:
        """Every (worker, parent hash, block hash, local hash) held: what a dump replays, one block a store.

        Each worker's blocks are copied as it is reached (in C, ~20 ns a block), so that the iteration may be
        suspended while blocks are stored and removed (a dump taken in slices)."""
        for worker, held in list(self._held.items()):
            for block, (parent, local) in list(held.items()):
                yield worker, parent, block, local
