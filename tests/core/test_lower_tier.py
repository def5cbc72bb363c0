"""The slower tiers' continuation index (Dynamo's LowerTierIndexer): how far a worker's match continues."""

from __future__ import annotations

from kvctl.core.events import Cleared, Removed, RouterEvent, Stored, Tier
from kvctl.core.hashing import local_block_hashes
from kvctl.core.index import KvIndex, Status

TOKENS = list(range(1, 25))  # 6 blocks of 4
LOCAL = local_block_hashes(TOKENS, 4)
H = [100 + i for i in range(6)]  # the engine's block hashes
W, V = (1, 0), (2, 0)


def store(index: KvIndex, worker: tuple[int, int], first: int, last: int, tier: Tier = Tier.device,
          parent: int | None = -1) -> Status:
    parent_hash = (H[first - 1] if first else None) if parent == -1 else parent
    event = RouterEvent(worker[0], Stored(parent_hash, H[first:last], LOCAL[first:last], tier), worker[1])
    return index.apply(event).status


def tiers(index: KvIndex) -> dict[Tier, dict[tuple[int, int], int]]:
    return {t: {w: n for w, n in d.items() if n} for t, d in index.find_matches(LOCAL).by_tier.items()}


def test_a_host_store_continues_the_device_match_from_its_parent() -> None:
    index = KvIndex()
    store(index, W, 0, 2)
    assert store(index, W, 2, 4, Tier.host_pinned) is Status.ok  # parent H[1] only the device tier holds
    store(index, W, 4, 6, Tier.disk)
    assert tiers(index) == {Tier.device: {W: 2}, Tier.host_pinned: {W: 2}, Tier.disk: {W: 2}}


def test_slower_tiers_count_only_beyond_the_faster_ones() -> None:
    index = KvIndex()
    store(index, W, 0, 1)
    store(index, W, 0, 3, Tier.host_pinned)  # overlaps the device block: 2 beyond it
    store(index, W, 0, 5, Tier.disk)  # 2 beyond the host
    store(index, V, 0, 4, Tier.disk)  # no device, no host: from the root
    assert tiers(index) == {Tier.device: {W: 1}, Tier.host_pinned: {W: 2}, Tier.disk: {W: 2, V: 4}}


def test_a_chain_another_worker_holds_does_not_count() -> None:
    index = KvIndex()
    store(index, W, 0, 2)
    store(index, V, 0, 2)
    store(index, V, 2, 4, Tier.host_pinned)
    assert tiers(index)[Tier.host_pinned] == {V: 2}


def test_removal_stops_at_the_first_block_not_held() -> None:
    index = KvIndex()
    store(index, W, 0, 4, Tier.host_pinned)
    result = index.apply(RouterEvent(1, Removed([H[3], 999, H[0]], Tier.host_pinned)))
    assert (result.status, result.blocks, result.missing) == (Status.block_not_found, 1, 2)
    assert tiers(index)[Tier.host_pinned] == {W: 3}  # H[0] stayed: Dynamo stops at the unknown hash


def test_a_conflicting_store_keeps_the_first_mapping() -> None:
    index = KvIndex()
    store(index, W, 0, 2, Tier.host_pinned)
    conflicting = RouterEvent(2, Stored(None, [555, H[1]], LOCAL[:2], Tier.host_pinned))  # block 0 hashed otherwise
    assert index.apply(conflicting).status is Status.ok  # never refused, only skipped
    assert tiers(index)[Tier.host_pinned] == {W: 2}  # V's first block is skipped, so its chain from the root is gone


def test_clear_and_remove_worker_reach_the_slower_tiers() -> None:
    index = KvIndex()
    store(index, W, 0, 3, Tier.host_pinned)
    store(index, (1, 1), 0, 3, Tier.host_pinned)
    index.apply(RouterEvent(1, Cleared(), 0))
    assert tiers(index)[Tier.host_pinned] == {(1, 1): 3}  # the event's rank only
    assert index.remove_worker(1) == 3
    assert tiers(index)[Tier.host_pinned] == {}


def test_a_dump_replays_into_the_same_matches_and_stats() -> None:
    index = KvIndex()
    store(index, W, 0, 2)
    store(index, W, 2, 4, Tier.host_pinned)
    store(index, V, 0, 5, Tier.disk)
    fresh = KvIndex()
    assert all(r.status is Status.ok for r in fresh.load(index.dump()))
    assert tiers(fresh) == tiers(index)
    assert fresh.stats() == index.stats()
