"""A mock engine's prefix-caching KV cache: what vLLM's BlockPool does, minus the GPU.

The device tier holds `capacity` blocks. A request pins the blocks it uses (ref counts); blocks
nobody pins stay cached and are evicted least recently used first, the tail of a request before
its head (vLLM frees a request's blocks in reverse order for exactly that reason). A request's
cache hit is the contiguous prefix of its full blocks found in the cache, so the events describe
the same prefix tree a router indexes.

With host and/or disk tiers (KVBM-style offloading), an evicted device block moves down to the
host (else disk) tier and a host eviction moves down to disk; each tier is an LRU of its own
size. A device miss found on a lower tier is onboarded: copied back to the device (counted), the
lower copy stays. Offloaded blocks are announced like vLLM's offloading connector does: one
BlockStored per block with no parent.

Every change of content is returned as events, in an order whose replay rebuilds the content
exactly (Removed before any re-Stored of the same block). `clear()` drops every tier at once and returns
one `CacheCleared` (vLLM's reset_prefix_cache announces it so); a restarted engine uses it too, and says
nothing. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvctl.core.events.types import Tier
from kvctl.mock.hashing import BlockHasher

Tokens = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CacheStored:
    """Blocks now cached on `tier`: a chain under `parent` (None: no parent given), tokens concatenated."""

    tier: Tier
    parent: int | None
    hashes: tuple[int, ...]
    tokens: Tokens


@dataclass(frozen=True, slots=True)
class CacheRemoved:
    tier: Tier
    hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CacheCleared:
    """Every block of every tier dropped at once."""


CacheEvent = CacheStored | CacheRemoved | CacheCleared


@dataclass(frozen=True, slots=True)
class Allocation:
    """What a request got: the device blocks it pins until released, its hits per tier, and the events."""

    generation: int
    blocks: tuple[int, ...]
    prompt_blocks: int
    hits: Mapping[Tier, int]
    events: tuple[CacheEvent, ...]

    @property
    def cached_blocks(self) -> int:
        """Prefix blocks the request did not compute: device hits plus onboarded blocks."""
        return sum(self.hits.values())


@dataclass(slots=True)
class Transfers:
    """Blocks moved between tiers so far, in KVBM's names (h2d offload is host to disk, d2d device to disk)."""

    offload_d2h: int = 0
    offload_h2d: int = 0
    offload_d2d: int = 0
    onboard_h2d: int = 0
    onboard_d2d: int = 0


class _Lru:
    """A lower tier: block hash -> tokens, least recently used first."""

    def __init__(self, tier: Tier, capacity: int) -> None:
        self.tier = tier
        self.capacity = capacity
        self.blocks: OrderedDict[int, Tokens] = OrderedDict()


class PrefixCache:
    """Prefix-caching block cache of one engine (one dp rank)."""

    def __init__(
        self, capacity: int, block_size: int, hasher: BlockHasher, *, host_capacity: int = 0, disk_capacity: int = 0
    ) -> None:
        if capacity <= 0 or block_size <= 0 or host_capacity < 0 or disk_capacity < 0:
            raise ValueError("capacity and block_size must be positive, tier capacities not negative")
        self.capacity = capacity
        self.block_size = block_size
        self.hasher = hasher
        self.transfers = Transfers()
        self.generation = 0
        self._device: dict[int, Tokens] = {}
        self._refs: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict()  # cached, unpinned: eviction order
        self._host = _Lru(Tier.host_pinned, host_capacity)
        self._disk = _Lru(Tier.disk, disk_capacity)

    @property
    def used_blocks(self) -> int:
        """Device blocks pinned by running requests (vLLM's KV usage counts only these)."""
        return len(self._refs)

    def contents(self, tier: Tier) -> set[int]:
        """The block hashes cached on one tier."""
        if tier is Tier.device:
            return set(self._device)
        return set(self._lower(tier).blocks)

    def allocate(self, token_ids: Sequence[int]) -> Allocation:
        """Pin a request's full prompt blocks on the device, computing or onboarding the missing ones.

        Blocks that do not fit (every device block pinned) are simply not cached.
        """
        chain = self.hasher.chain(token_ids, self.block_size)
        hits = self._prefix_hits(chain)
        present = [position for position, (h, _) in enumerate(chain) if h in self._device]
        for position in present:
            self._pin(chain[position][0])
        events: list[CacheEvent] = []
        new: list[int] = []
        for position, (h, tokens) in enumerate(chain):
            if h in self._device:
                continue
            if len(self._device) >= self.capacity and not self._free:
                break
            self._onboard(h)  # before evicting: the eviction's cascade may push this very copy out
            if len(self._device) >= self.capacity:
                self._evict_one(events)
            self._device[h] = tokens
            self._pin(h)
            new.append(position)
        runs = [self._stored_run(chain, run) for run in _consecutive_runs(new)]
        held = tuple(chain[position][0] for position in sorted(present + new))
        return Allocation(self.generation, held, len(chain), hits, (*events, *runs))

    def release(self, allocation: Allocation) -> None:
        """Unpin a request's blocks; they stay cached. A pre-restart allocation is ignored."""
        if allocation.generation != self.generation:
            return
        for h in reversed(allocation.blocks):
            self._refs[h] -= 1
            if not self._refs[h]:
                del self._refs[h]
                self._free[h] = None

    def clear(self) -> tuple[CacheEvent, ...]:
        """Forget everything; outstanding allocations go stale (running requests' blocks are dropped too,
        where vLLM would refuse until they finish: the mock's callers clear between workloads)."""
        self.generation += 1
        self._device.clear()
        self._refs.clear()
        self._free.clear()
        self._host.blocks.clear()
        self._disk.blocks.clear()
        return (CacheCleared(),)

    def _prefix_hits(self, chain: Sequence[tuple[int, Tokens]]) -> dict[Tier, int]:
        hits: Counter[Tier] = Counter()
        for h, _ in chain:
            tier = self._where(h)
            if tier is None:
                break
            hits[tier] += 1
        return dict(hits)

    def _where(self, h: int) -> Tier | None:
        if h in self._device:
            return Tier.device
        return next((lru.tier for lru in (self._host, self._disk) if h in lru.blocks), None)

    def _pin(self, h: int) -> None:
        self._refs[h] = self._refs.get(h, 0) + 1
        self._free.pop(h, None)

    @staticmethod
    def _stored_run(chain: Sequence[tuple[int, Tokens]], run: range) -> CacheStored:
        """One Stored for consecutive new blocks, under the chain block before them (None at the root)."""
        parent = chain[run.start - 1][0] if run.start else None
        blocks = [chain[position] for position in run]
        return CacheStored(Tier.device, parent, tuple(h for h, _ in blocks), tuple(t for _, ts in blocks for t in ts))

    def _onboard(self, h: int) -> None:
        """Count (and touch) a lower-tier copy of a block about to be stored on the device."""
        if h in self._host.blocks:
            self._host.blocks.move_to_end(h)
            self.transfers.onboard_h2d += 1
        elif h in self._disk.blocks:
            self._disk.blocks.move_to_end(h)
            self.transfers.onboard_d2d += 1

    def _evict_one(self, events: list[CacheEvent]) -> None:
        """Evict the least recently used unpinned device block, offloading it to the next tier down."""
        h, _ = self._free.popitem(last=False)
        tokens = self._device.pop(h)
        events.append(CacheRemoved(Tier.device, (h,)))
        if self._host.capacity:
            self.transfers.offload_d2h += 1
            self._offload(self._host, h, tokens, events)
        elif self._disk.capacity:
            self.transfers.offload_d2d += 1
            self._offload(self._disk, h, tokens, events)

    def _offload(self, lru: _Lru, h: int, tokens: Tokens, events: list[CacheEvent]) -> None:
        if h in lru.blocks:
            lru.blocks.move_to_end(h)
            return
        if len(lru.blocks) >= lru.capacity:
            old, old_tokens = lru.blocks.popitem(last=False)
            events.append(CacheRemoved(lru.tier, (old,)))
            if lru is self._host and self._disk.capacity:
                self.transfers.offload_h2d += 1
                self._offload(self._disk, old, old_tokens, events)
        lru.blocks[h] = tokens
        events.append(CacheStored(lru.tier, None, (h,), tokens))

    def _lower(self, tier: Tier) -> _Lru:
        if tier is Tier.host_pinned:
            return self._host
        if tier is Tier.disk:
            return self._disk
        raise ValueError(f"a mock engine has no {tier} tier")


def _consecutive_runs(positions: Sequence[int]) -> list[range]:
    """Sorted positions grouped into maximal runs of consecutive values."""
    runs: list[range] = []
    for position in positions:
        if runs and runs[-1].stop == position:
            runs[-1] = range(runs[-1].start, position + 1)
        else:
            runs.append(range(position, position + 1))
    return runs
