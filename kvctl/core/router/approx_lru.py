"""Dynamo 1.6.1's approximate LRU retention (`--router-approximate-cache-policy lru`, docs/contract.md): instead of
a timer per block, each (worker, dp_rank) holds copies of the blocks routed to it against its KV capacity (its
card's `total_kv_blocks`), and only capacity pressure evicts.

A booked request acquires a copy of each of its prompt's blocks on its rank: while its prefix keeps hitting it
shares the rank's copy, after the first miss every block is a new copy. A prompt that ends in a partial block also
holds one private block (capacity, never indexed) while it lives. Freeing releases the copies; a copy no request
holds is inactive, stamped with its release's epoch. Whenever the rank's copies and private blocks pass its
capacity, inactive copies go: the oldest release first, within it the deepest block first. Active copies never go,
so a rank can stay over capacity until a release. A hash leaves the index with its last copy.

A rank with no positive capacity falls back to TTL retention for as long as it is known (Dynamo's `None` is
sticky); a rank forgotten and seen again starts afresh. Pure: the caller applies the removed hashes to its index.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from kvctl.core.names import WorkerKey, selects


class CachePolicy(StrEnum):
    """Dynamo's `--router-approximate-cache-policy`: a timer per block (approx.py), or this module's retention."""

    ttl = "ttl"
    lru = "lru"


@dataclass(slots=True)
class _Copy:
    block: int  # sequence hash
    refs: int
    release_epoch: int
    pos: int  # its position in the prompt that last acquired it


class RankLru:
    """One rank's block copies against its capacity (Dynamo's `RankLruState`)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.release_epoch = 0
        self.private = 0  # the live leases' private blocks
        self._next_copy = 1
        self._copies: dict[int, _Copy] = {}
        self._by_hash: dict[int, list[int]] = {}
        self._leases: dict[str, tuple[list[int], int]] = {}  # request id -> (copy ids, private blocks)
        # Inactive copies by (release epoch, -position, copy id); entries of copies since hit or evicted are stale,
        # skipped when popped (a copy's key changes only while it is active).
        self._inactive: list[tuple[int, int, int]] = []

    @property
    def resident(self) -> int:
        """Copies, active and inactive, and private blocks: what the capacity bounds."""
        return len(self._copies) + self.private

    def acquire(self, request_id: str, blocks: Sequence[int], private: int) -> list[int]:
        """A booked request's prompt blocks (sequence hashes) on this rank; returns the hashes evicted for room.
        The caller refuses a request id already held (Dynamo: a duplicate attempt records nothing)."""
        ids: list[int] = []
        hitting = True
        for pos, block in enumerate(blocks):
            held = self._by_hash.get(block) if hitting else None
            if held:
                copy_id = held[0]
                copy = self._copies[copy_id]
                copy.refs += 1
                copy.pos = pos
            else:
                hitting = False
                copy_id = self._next_copy
                self._next_copy += 1
                self._copies[copy_id] = _Copy(block, 1, 0, pos)
                self._by_hash.setdefault(block, []).append(copy_id)
            ids.append(copy_id)
        self.private += private
        self._leases[request_id] = (ids, private)
        return self.reconcile()

    def release(self, request_id: str) -> list[int]:
        """A request freed (or expired): its copies one reference less, those no request holds now inactive in one
        new epoch; returns the hashes evicted. A request not held changes nothing, not even the epoch."""
        lease = self._leases.pop(request_id, None)
        if lease is None:
            return []
        ids, private = lease
        self.release_epoch += 1
        self.private -= private
        for copy_id in ids:
            copy = self._copies[copy_id]
            copy.refs -= 1
            if not copy.refs:
                copy.release_epoch = self.release_epoch
                heapq.heappush(self._inactive, (copy.release_epoch, -copy.pos, copy_id))
        return self.reconcile()

    def set_capacity(self, capacity: int) -> list[int]:
        """A new advertised capacity: a lower one evicts at once."""
        self.capacity = capacity
        return self.reconcile()

    def reconcile(self) -> list[int]:
        """Evict inactive copies, oldest release and deepest block first, while over capacity; the hashes whose
        last copy went, in eviction order."""
        removed: list[int] = []
        inactive, copies = self._inactive, self._copies
        while self.resident > self.capacity and inactive:
            epoch, neg_pos, copy_id = heapq.heappop(inactive)
            copy = copies.get(copy_id)
            if copy is None or copy.refs or (copy.release_epoch, -copy.pos) != (epoch, neg_pos):
                continue  # stale: hit again since, or already evicted
            del copies[copy_id]
            held = self._by_hash[copy.block]
            at = held.index(copy_id)
            held[at] = held[-1]  # Dynamo's swap_remove: which copy a later hit takes depends on it
            held.pop()
            if not held:
                del self._by_hash[copy.block]
                removed.append(copy.block)
        if len(inactive) > 2 * len(copies) + 64:  # stale entries past twice the live ones: drop them
            self._inactive = [k for k in inactive if (c := copies.get(k[2])) is not None and not c.refs
                              and (c.release_epoch, -c.pos) == k[:2]]
            heapq.heapify(self._inactive)
        return removed

    @property
    def overcapacity(self) -> int:
        return max(0, self.resident - self.capacity)


@dataclass(frozen=True, slots=True)
class LruStats:
    lru_ranks: int  # ranks retained by capacity
    ttl_ranks: int  # ranks with no capacity advertised: TTL retention
    resident_blocks: int  # copies and private blocks, every LRU rank
    overcapacity_blocks: int  # past capacity, held by requests in flight


class LruRanks:
    """Every rank's retention, registered at its first booked route: LRU with a positive capacity, else TTL for as
    long as it is known; and which rank holds each booked request."""

    def __init__(self) -> None:
        self._ranks: dict[WorkerKey, RankLru | None] = {}  # None: TTL fallback
        self._leases: dict[str, WorkerKey] = {}

    def rank(self, worker: WorkerKey, capacity: int | None) -> tuple[RankLru | None, list[int], bool]:
        """The rank's state with `capacity` (its card's) applied, None on TTL fallback; the hashes a lower capacity
        evicted; and whether a capacity gone away just cleared the rank (it is on TTL fallback from now on)."""
        positive = capacity if capacity is not None and capacity > 0 else None
        if worker not in self._ranks:
            state = self._ranks[worker] = RankLru(positive) if positive is not None else None
            return state, [], False
        state = self._ranks[worker]
        if state is None:
            return None, [], False
        if positive is None:
            self._ranks[worker] = None
            for request_id in [r for r, w in self._leases.items() if w == worker]:
                del self._leases[request_id]
            return None, [], True
        return state, state.set_capacity(positive) if positive != state.capacity else [], False

    def acquire(self, request_id: str, worker: WorkerKey, state: RankLru, blocks: Sequence[int],
                private: int) -> list[int] | None:
        """None (nothing recorded) for a request id already held anywhere, as Dynamo refuses a duplicate attempt."""
        if request_id in self._leases:
            return None
        self._leases[request_id] = worker
        return state.acquire(request_id, blocks, private)

    def release(self, request_id: str) -> tuple[WorkerKey, list[int]] | None:
        worker = self._leases.pop(request_id, None)
        state = None if worker is None else self._ranks.get(worker)
        if worker is None or state is None:
            return None
        return worker, state.release(request_id)

    def forget(self, worker_id: int, dp_rank: int | None = None) -> None:
        """A worker gone: seen again, its ranks start afresh (Dynamo's new incarnation), old leases ignored."""
        for worker in [w for w in self._ranks if selects((worker_id, dp_rank), w)]:
            del self._ranks[worker]
        for request_id in [r for r, w in self._leases.items() if selects((worker_id, dp_rank), w)]:
            del self._leases[request_id]

    def stats(self) -> LruStats:
        ranks = [r for r in self._ranks.values() if r is not None]
        return LruStats(len(ranks), len(self._ranks) - len(ranks), sum(r.resident for r in ranks),
                        sum(r.overcapacity for r in ranks))
