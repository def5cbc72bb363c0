"""Dynamo's approximate mode: a KV index fed by the router's own decisions (docs/contract.md).

When engines publish no KV events, the router assumes that a request's prompt blocks sit in the
cache of the worker it was sent to, for a while: each routing decision is recorded as a synthetic
`Stored` (parent None, blocks `(seq_i, local_i)`) and every block gets a timer `now + ttl` that a
later decision for the same block refreshes. Expired blocks, and the oldest ones once the index
holds more (worker, block) pairs than `max_tree_size`, leave through single-block `Removed` events,
so the index stays the same `KvIndex` that event-fed routers use (Dynamo's `KvIndexer` with a
`PruneManager`, lib/kv-router/src/indexer/pruning.rs).

Timers follow Dynamo's `PruneManager`: a dict of current expiries per (worker, sequence hash,
position) is the truth, and a heap ordered by expiry is invalidated lazily (a refreshed timer leaves
its old heap entry behind, skipped when popped) and rebuilt once it holds more than 50 entries per
live timer. Timers that fall due together leave in Dynamo's order: the largest `BlockEntry`
(position, then sequence hash, then worker) first, so the deepest blocks of a request leave before
their prefix and a worker never loses a block while still holding a descendant of it.

Where kvctl differs on purpose:
- the heap holds one entry per recorded request (its expiry, worker, hashes), not one per block: a
  record costs one heap push, and timers cost about 125 bytes a block rather than 250 (some 130 MB
  less at the default cap of 2^20 blocks, where the tree itself takes about 115 MB). Items due at the
  same instant are merged and sorted when they fall due, which gives exactly Dynamo's per-block order;
- timers are grouped per worker, so `remove_worker` drops them instead of leaving them to fire
  `Removed` events for a worker that is gone (which would bring it back into the index);
- stale heap entries are dropped as soon as no timer is live, so memory returns to its baseline once
  everything expired.

Time is always passed in (`now`, monotonic seconds): this module reads no clock.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import count

from kvctl.core.events import Cleared, EventData, Removed, RouterEvent, Stored
from kvctl.core.index import IndexMatches, KvIndex
from kvctl.core.names import WorkerKey, selects
from kvctl.core.router.approx_lru import CachePolicy, LruRanks

HEAP_REBUILD_FACTOR = 50
"""Rebuild the heap when it holds more than this many block entries per live timer (Dynamo's threshold)."""

# One recorded request in the heap: (expiry, tie-break counter, (worker, sequence hashes, their positions)).
_Batch = tuple[WorkerKey, list[int], Sequence[int]]
_HeapItem = tuple[float, int, _Batch]


@dataclass(frozen=True, slots=True)
class ApproxConfig:
    """Dynamo's `PruneConfig` (`--router-ttl`, `--router-max-tree-size`, `--router-prune-target-ratio`)."""

    ttl_s: float = 120.0
    max_tree_size: int = 2**20
    prune_target_ratio: float = 0.8
    policy: CachePolicy = CachePolicy.ttl

    def __post_init__(self) -> None:
        if not self.ttl_s > 0:  # also rejects NaN
            raise ValueError(f"ttl_s must be > 0, got {self.ttl_s!r}")
        if isinstance(self.max_tree_size, bool) or not isinstance(self.max_tree_size, int) or self.max_tree_size < 1:
            raise ValueError(f"max_tree_size must be an integer >= 1, got {self.max_tree_size!r}")
        if not 0 < self.prune_target_ratio <= 1:
            raise ValueError(f"prune_target_ratio must be in (0, 1], got {self.prune_target_ratio!r}")

    @property
    def prune_target(self) -> int:
        """(worker, block) pairs kept after a prune: floor(max × ratio), as Dynamo's `as usize` cast."""
        return int(self.max_tree_size * self.prune_target_ratio)


@dataclass(frozen=True, slots=True)
class ApproxStats:
    """What approximate mode holds, for memory checks: index size and timer bookkeeping."""

    blocks: int  # (worker, block) pairs in the index: what max_tree_size bounds
    nodes: int  # radix tree nodes
    timers: int  # live (worker, sequence hash, position) timers
    heap: int  # block entries in the heap, live and stale (at most 50 per live timer)


class ApproxIndexer:
    """A `KvIndex` fed by routing decisions, with Dynamo's TTL expiry and size cap.

    It owns its index: events from anywhere else would desynchronise the timers from the blocks.
    Read it through `index` (dumps, tree sizes), never write to it.
    """

    def __init__(self, config: ApproxConfig | None = None,
                 capacity: Callable[[WorkerKey], int | None] | None = None) -> None:
        """`capacity`: a rank's advertised KV blocks (its card's), which the LRU policy retains blocks against."""
        self.config = config if config is not None else ApproxConfig()
        self.lru = LruRanks() if self.config.policy is CachePolicy.lru else None
        self.capacity = capacity if capacity is not None else (lambda _: None)
        self._index = KvIndex()
        self._tree = self._index.device
        self._timers: dict[WorkerKey, dict[tuple[int, int], float]] = {}  # worker -> (seq hash, position) -> expiry
        self._live = 0  # timers over all workers
        self._heap: list[_HeapItem] = []
        self._heap_blocks = 0  # block entries over all heap items, live and stale
        self._order = count()  # heap tie-break: items due at the same instant never compare their batches
        self._event_id = 0
        self.pruned = 0  # (worker, block) pairs the --max-tree-size cap pruned: kvctl's bound, not 1.6.1's

    @property
    def index(self) -> KvIndex:
        return self._index

    @property
    def last_event_id(self) -> int:
        """Id of the last synthetic event applied: router-local, one per Stored and per Removed, as Dynamo."""
        return self._event_id

    # ----- writes --------------------------------------------------------------------------------------

    def record(self, worker: WorkerKey, local_hashes: Sequence[int], sequence_hashes: Sequence[int], now: float,
               *, request_id: str | None = None, private: int = 0) -> int:
        """Assume `worker` now caches this request's blocks; returns the (worker, block) pairs pruned or evicted.

        TTL: every block's timer is set (or refreshed) to `now + ttl`; an empty request changes nothing. LRU (a
        booked `request_id`, on a rank with a capacity): the rank acquires the blocks and `private` more (a prompt
        ending in a partial block), evicting for room; nothing for a request id it holds already.
        """
        n = len(local_hashes)
        if n != len(sequence_hashes):
            raise ValueError(f"{n} local hashes but {len(sequence_hashes)} sequence hashes")
        if not math.isfinite(now):
            raise ValueError(f"now must be finite, got {now!r}")  # a NaN expiry could never fire nor be refreshed
        keys = list(sequence_hashes)
        if self.lru is not None and request_id is not None:
            state, evicted, cleared = self.lru.rank(worker, self.capacity(worker))
            if cleared:
                self._apply(worker, Cleared())
            self._evict(worker, evicted)
            if state is not None:
                removed = self.lru.acquire(request_id, worker, state, keys, private)
                if removed is None:
                    return 0
                if n:
                    self._apply(worker, Stored(None, keys[:], list(local_hashes)))
                self._evict(worker, removed)
                return len(evicted) + len(removed)
        if not n:
            return 0
        # The event gets its own list: the batch below must not share one with the tree's edges.
        self._apply(worker, Stored(None, keys[:], list(local_hashes)))
        expiry = now + self.config.ttl_s
        timers = self._timers.get(worker)
        if timers is None:
            timers = self._timers[worker] = {}
        before = len(timers)
        for pos, key in enumerate(keys):
            timers[(key, pos)] = expiry
        self._live += len(timers) - before
        heapq.heappush(self._heap, (expiry, next(self._order), (worker, keys, range(n))))
        self._heap_blocks += n
        self._maybe_rebuild()
        size = self._tree.blocks
        if size <= self.config.max_tree_size:
            return 0
        # The earlier PruneManager's prune: pop `size − target` live timers in heap order, each a single-block
        # Removed. 1.6.1 has no cap: what this prunes, its router would still hold, so it is counted.
        self._drain(math.inf, size - self.config.prune_target)
        self.pruned += size - self._tree.blocks
        return size - self._tree.blocks

    def release(self, request_id: str) -> int:
        """A booked request freed or expired: under LRU its rank releases its blocks (evicting what no longer fits);
        returns the (worker, block) pairs evicted."""
        released = self.lru.release(request_id) if self.lru is not None else None
        if released is None:
            return 0
        worker, removed = released
        self._evict(worker, removed)
        return len(removed)

    def _apply(self, worker: WorkerKey, data: EventData) -> None:
        self._event_id += 1
        self._index.apply(RouterEvent(worker[0], data, worker[1], self._event_id))

    def _evict(self, worker: WorkerKey, blocks: list[int]) -> None:
        if blocks:
            self._apply(worker, Removed(blocks))

    def expire(self, now: float) -> int:
        """Remove every block whose timer is due (expiry ≤ now); returns the (worker, block) pairs removed."""
        heap = self._heap
        if not heap or heap[0][0] > now:
            return 0
        before = self._tree.blocks
        self._drain(now, math.inf)
        return before - self._tree.blocks

    def remove_worker(self, worker_id: int, dp_rank: int | None = None) -> int:
        """Forget a worker (all its dp ranks, or one) and its timers; returns the blocks it held."""
        for worker in [w for w in self._timers if selects((worker_id, dp_rank), w)]:
            self._live -= len(self._timers.pop(worker))
        if self.lru is not None:
            self.lru.forget(worker_id, dp_rank)
        self._maybe_rebuild()
        return self._index.remove_worker(worker_id, dp_rank)

    # ----- reads ---------------------------------------------------------------------------------------

    def find_matches(self, local_hashes: Sequence[int]) -> IndexMatches:
        """Overlap scores and tree sizes, exactly as an event-fed index answers them."""
        return self._index.find_matches(local_hashes)

    def next_expiry(self) -> float | None:
        """When the next timer is due, for a server to sleep until then; None when no timer is live.

        Heap items with no live timer left are dropped first, so the answer is never an early wake-up.
        """
        heap = self._heap
        while heap and not self._any_live(heap[0]):
            self._heap_blocks -= len(heapq.heappop(heap)[2][1])
        return heap[0][0] if heap else None

    def size(self) -> int:
        """(worker, block) pairs in the index: Dynamo's `current_size`, what `max_tree_size` bounds."""
        return self._tree.blocks

    def stats(self) -> ApproxStats:
        return ApproxStats(self._tree.blocks, self._tree.nodes, self._live, self._heap_blocks)

    # ----- internals -----------------------------------------------------------------------------------

    def _drain(self, until: float, budget: float) -> None:
        """Fire up to `budget` live timers due by `until`, earliest expiry first, then largest BlockEntry first.

        All heap items due at one instant are taken together and their blocks sorted, so the order
        is Dynamo's per-block heap order. When the budget runs out inside such a group, the group's
        items go back on the heap: the blocks fired meanwhile are stale in them now.

        Dynamo applies each fired block as its own one-block `Removed`; here each worker's fired blocks
        go out as one `Removed`, in firing order (its ids advance by one per block all the same). A
        worker's removals never touch another worker's pairs, so the index ends the same, and a prune of
        thousands of blocks costs a few index calls instead of one per block: it ran 15 ms at a 20k cap
        with one call per block, a stall every route behind it waited out.
        """
        heap = self._heap
        pop = heapq.heappop
        fired: dict[WorkerKey, list[int]] = {}
        n = 0
        while heap and heap[0][0] <= until and n < budget:
            expiry = heap[0][0]
            group = [pop(heap)]
            while heap and heap[0][0] == expiry:
                group.append(pop(heap))
            due = sorted(
                ((pos, key, worker) for _, _, (worker, keys, positions) in group
                 for key, pos in zip(keys, positions, strict=True)),
                reverse=True,
            )
            for pos, key, worker in due:
                if n >= budget:
                    for item in group:
                        heapq.heappush(heap, item)
                    break
                if self._take(worker, key, pos, expiry):
                    fired.setdefault(worker, []).append(key)
                    n += 1
            else:
                self._heap_blocks -= len(due)
        for (worker_id, dp_rank), keys in fired.items():
            self._event_id += len(keys)
            self._index.apply(RouterEvent(worker_id, Removed(keys), dp_rank, self._event_id))
        self._maybe_rebuild()

    def _take(self, worker: WorkerKey, key: int, pos: int, expiry: float) -> bool:
        """Drop one due block's timer if it is still this one (not refreshed since, nor its worker removed)."""
        timers = self._timers.get(worker)
        if timers is None or timers.get((key, pos)) != expiry:
            return False
        del timers[(key, pos)]
        if not timers:
            del self._timers[worker]
        self._live -= 1
        return True

    def _any_live(self, item: _HeapItem) -> bool:
        expiry, _, (worker, keys, positions) = item
        timers = self._timers.get(worker)
        return timers is not None and any(timers.get(k) == expiry for k in zip(keys, positions, strict=True))

    def _maybe_rebuild(self) -> None:
        """Drop stale heap entries once they outnumber live timers 50 to 1 (all of them when none is live).

        Live timers are regrouped one heap item per (worker, expiry), the shape records give them.
        """
        if self._heap_blocks <= HEAP_REBUILD_FACTOR * self._live:
            return
        groups: dict[tuple[WorkerKey, float], tuple[list[int], list[int]]] = {}
        for worker, timers in self._timers.items():
            for (key, pos), expiry in timers.items():
                keys, positions = groups.setdefault((worker, expiry), ([], []))
                keys.append(key)
                positions.append(pos)
        order = self._order
        self._heap = [(expiry, next(order), (worker, keys, positions))
                      for (worker, expiry), (keys, positions) in groups.items()]
        heapq.heapify(self._heap)
        self._heap_blocks = self._live
