"""The mock KV cache: real engine hashes, and an event stream that always describes its content."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.core.events import Tier
from kvctl.mock.cache import Allocation, CacheCleared, CacheRemoved, CacheStored, PrefixCache
from kvctl.mock.hashing import BlockHasher, HashStyle
from tests.fixtures_path import FIXTURES

B = 4


def _messages(folder: str) -> dict[str, dict]:
    manifest = json.loads((FIXTURES / folder / "manifest.json").read_text())
    return {m["file"][0]: m["decoded_expectation"]["events"][0] for m in manifest["messages"]}


def test_vllm_hashes_are_the_real_engines() -> None:
    events = _messages("vllm-0.33")
    a, b = events["a"], events["b"]
    chain = BlockHasher(HashStyle.vllm).chain(a["token_ids"] + b["token_ids"], 16)
    assert [h for h, _ in chain] == a["block_hashes"] + b["block_hashes"]
    assert b["parent_block_hash"] == a["block_hashes"][-1]


def test_sglang_hashes_are_the_real_engines() -> None:
    events = _messages("sglang-0.5.23")
    a, b = events["a"], events["b"]
    chain = BlockHasher(HashStyle.sglang).chain(a["token_ids"] + b["token_ids"], 16)
    assert [h for h, _ in chain] == a["block_hashes"] + b["block_hashes"]


def test_a_root_seed_changes_every_hash() -> None:
    tokens = list(range(32))
    fixed = BlockHasher(HashStyle.vllm).chain(tokens, 16)
    seeded = BlockHasher(HashStyle.vllm, root_seed=b"process-1").chain(tokens, 16)
    assert {h for h, _ in fixed}.isdisjoint(h for h, _ in seeded)
    assert [t for _, t in fixed] == [t for _, t in seeded]


def test_partial_trailing_block_is_not_cached() -> None:
    cache = PrefixCache(8, B, BlockHasher(HashStyle.vllm))
    alloc = cache.allocate(list(range(10)))
    assert alloc.prompt_blocks == 2
    assert alloc.events == (CacheStored(Tier.device, None, alloc.blocks, tuple(range(8))),)


def test_second_request_hits_the_shared_prefix_and_chains_under_it() -> None:
    cache = PrefixCache(8, B, BlockHasher(HashStyle.vllm))
    first = cache.allocate([1, 2, 3, 4, 5, 6, 7, 8])
    cache.release(first)
    second = cache.allocate([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    assert second.hits == {Tier.device: 2}
    assert second.events == (CacheStored(Tier.device, first.blocks[-1], second.blocks[2:], (9, 10, 11, 12)),)


def test_lru_evicts_the_tail_of_the_oldest_request_first() -> None:
    cache = PrefixCache(4, B, BlockHasher(HashStyle.vllm))
    old = cache.allocate(list(range(8)))
    cache.release(old)
    cache.release(cache.allocate(list(range(100, 108))))
    newest = cache.allocate(list(range(200, 204)))
    assert newest.events[0] == CacheRemoved(Tier.device, (old.blocks[1],))


def test_pinned_blocks_are_never_evicted_and_overflow_is_not_cached() -> None:
    cache = PrefixCache(2, B, BlockHasher(HashStyle.vllm))
    pinned = cache.allocate(list(range(8)))
    other = cache.allocate(list(range(100, 108)))
    assert other.blocks == () and other.events == ()
    assert cache.contents(Tier.device) == set(pinned.blocks)


def test_tiers_offload_then_onboard() -> None:
    cache = PrefixCache(1, B, BlockHasher(HashStyle.vllm), host_capacity=1, disk_capacity=1)
    first = cache.allocate([1, 2, 3, 4])
    cache.release(first)
    cache.release(cache.allocate([5, 6, 7, 8]))  # first -> host
    cache.release(cache.allocate([9, 10, 11, 12]))  # [5..8] -> host, first -> disk
    again = cache.allocate([1, 2, 3, 4])  # onboarded from disk; the cascade then drops disk's copy
    assert again.hits == {Tier.disk: 1}
    assert first.blocks[0] in cache.contents(Tier.device) - cache.contents(Tier.disk)
    t = cache.transfers
    assert (t.offload_d2h, t.offload_h2d, t.offload_d2d, t.onboard_h2d, t.onboard_d2d) == (3, 2, 0, 0, 1)


def test_clear_returns_one_cleared_and_makes_old_allocations_stale() -> None:
    cache = PrefixCache(4, B, BlockHasher(HashStyle.vllm))
    alloc = cache.allocate(list(range(8)))
    assert cache.clear() == (CacheCleared(),)
    cache.release(alloc)  # no KeyError: the blocks are gone with the restart
    assert cache.contents(Tier.device) == set() and cache.used_blocks == 0


class _Replay:
    """The reference model: the cache content a router rebuilds from the event stream alone."""

    def __init__(self) -> None:
        self.tiers: dict[Tier, set[int]] = {t: set() for t in (Tier.device, Tier.host_pinned, Tier.disk)}

    def apply(self, alloc: Allocation) -> None:
        for event in alloc.events:
            held = self.tiers[event.tier]
            if isinstance(event, CacheRemoved):
                assert set(event.hashes) <= held, "removed a block that was never stored"
                held.difference_update(event.hashes)
            else:
                assert event.parent is None or event.parent in held, "stored under an unknown parent"
                assert len(event.tokens) == len(event.hashes) * B
                held.update(event.hashes)


_prompts = st.lists(st.sampled_from([0, 1, 2]), min_size=0, max_size=5).map(
    lambda path: [t for depth, branch in enumerate(path) for t in [depth * 10 + branch] * B])


@settings(max_examples=300, deadline=None)
@given(
    capacity=st.integers(1, 6),
    host=st.integers(0, 4),
    disk=st.integers(0, 4),
    ops=st.lists(st.tuples(_prompts, st.booleans()), max_size=25),
)
def test_event_stream_replays_into_the_cache_content(capacity: int, host: int, disk: int, ops: list) -> None:
    cache = PrefixCache(capacity, B, BlockHasher(HashStyle.vllm), host_capacity=host, disk_capacity=disk)
    replay = _Replay()
    running: list[Allocation] = []
    for prompt, finish_oldest in ops:
        alloc = cache.allocate(prompt)
        replay.apply(alloc)
        running.append(alloc)
        assert alloc.cached_blocks <= alloc.prompt_blocks
        if finish_oldest:
            cache.release(running.pop(0))
        for tier, held in replay.tiers.items():
            assert held == cache.contents(tier)
        assert len(cache.contents(Tier.device)) <= capacity
        assert len(cache.contents(Tier.host_pinned)) <= host and len(cache.contents(Tier.disk)) <= disk
        pinned = {h for a in running for h in a.blocks}
        assert pinned <= cache.contents(Tier.device)
        assert cache.used_blocks == len(pinned)
