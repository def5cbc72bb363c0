"""Approximate LRU retention (`--router-approximate-cache-policy lru`, issue 38): each rank's booked blocks against
its capacity, evicted oldest release first and deepest first, against a reference model of Dynamo 1.6.1's rules
(`approximate_lru.rs`), and the picks 1.6.1's own `KvRouter` made on a two-worker fleet of 8 blocks each."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.core.events import Tier
from kvctl.core.hashing import local_block_hashes
from kvctl.core.names import WorkerKey
from kvctl.core.router.approx import ApproxConfig, ApproxIndexer
from kvctl.core.router.approx_lru import CachePolicy, RankLru
from kvctl.core.router.router import Router


@dataclass
class _Reference:
    """The rules as written, nothing kept sorted: every eviction scans every copy."""

    capacity: int
    epoch: int = 0
    next_id: int = 1
    copies: dict[int, list[int]] = field(default_factory=dict)  # id -> [hash, refs, epoch, pos]
    order: dict[int, list[int]] = field(default_factory=dict)  # hash -> copy ids, in Dynamo's swap_remove order
    leases: dict[str, tuple[list[int], int]] = field(default_factory=dict)
    private: int = 0

    def acquire(self, request: str, blocks: list[int], private: int) -> list[int]:
        ids, hitting = [], True
        for pos, block in enumerate(blocks):
            if hitting and self.order.get(block):
                copy_id = self.order[block][0]
                self.copies[copy_id][1] += 1
                self.copies[copy_id][3] = pos
            else:
                hitting = False
                copy_id, self.next_id = self.next_id, self.next_id + 1
                self.copies[copy_id] = [block, 1, 0, pos]
                self.order.setdefault(block, []).append(copy_id)
            ids.append(copy_id)
        self.leases[request] = (ids, private)
        self.private += private
        return self.evict()

    def release(self, request: str) -> list[int]:
        if request not in self.leases:
            return []
        ids, private = self.leases.pop(request)
        self.epoch += 1
        self.private -= private
        for copy_id in ids:
            self.copies[copy_id][1] -= 1
            if not self.copies[copy_id][1]:
                self.copies[copy_id][2] = self.epoch
        return self.evict()

    def evict(self) -> list[int]:
        removed = []
        while len(self.copies) + self.private > self.capacity:
            idle = [(c[2], -c[3], i) for i, c in self.copies.items() if not c[1]]
            if not idle:
                break
            copy_id = min(idle)[2]
            block = self.copies.pop(copy_id)[0]
            held = self.order[block]
            at = held.index(copy_id)
            held[at] = held[-1]
            held.pop()
            if not held:
                del self.order[block]
                removed.append(block)
        return removed


STEP = st.one_of(
    st.tuples(st.just("acquire"), st.integers(0, 5), st.lists(st.integers(0, 6), max_size=6), st.integers(0, 1)),
    st.tuples(st.just("release"), st.integers(0, 5)))


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8), st.lists(STEP, max_size=40))
def test_a_rank_evicts_as_the_reference_model(capacity: int, steps: list[tuple]) -> None:
    rank, model = RankLru(capacity), _Reference(capacity)
    for step in steps:
        request = f"r{step[1]}"
        if step[0] == "acquire":
            if request in model.leases:
                continue  # a duplicate attempt records nothing (LruRanks' check, before the rank's)
            assert rank.acquire(request, step[2], step[3]) == model.acquire(request, step[2], step[3])
        else:
            assert rank.release(request) == model.release(request)
        assert rank.resident == len(model.copies) + model.private


def test_the_oldest_release_goes_first_then_the_deepest_block() -> None:
    rank = RankLru(4)
    rank.acquire("a", [1, 2], 0)
    rank.acquire("b", [7, 8], 0)
    assert rank.release("b") == [] and rank.release("a") == []  # b released first: its epoch is the older
    assert rank.acquire("c", [20, 21], 0) == [8, 7]  # b's deepest block, then its prefix
    assert rank.acquire("d", [30], 0) == [2] and rank.overcapacity == 0


def test_blocks_in_use_are_never_evicted_so_a_rank_can_sit_over_capacity() -> None:
    rank = RankLru(2)
    assert rank.acquire("a", [1, 2, 3], 1) == [] and rank.overcapacity == 2
    assert rank.release("a") == [3]  # its private block gone, 3 of 2: the prefix that fits stays
    assert rank.release("a") == [] and rank.release_epoch == 1  # freed twice: no second epoch


WORKERS = [(1, 0), (2, 0)]


def _router(policy: CachePolicy, capacity: int | None = 8, ttl_s: float = 120.0) -> Router:
    """Two ranks of `capacity` blocks each (their cards' total_kv_blocks), block size 16, temperature 0."""
    approx = ApproxIndexer(ApproxConfig(ttl_s=ttl_s, policy=policy), capacity=lambda _: capacity)
    return Router(block_size=16, approx=approx, rng=random.Random(0))


def _probe(policy: CachePolicy) -> tuple[int, int, int, dict[WorkerKey, int]]:
    """The steps 1.6.1's `KvRouter` took on two mockers of 8 blocks (`--num-gpu-blocks-override 8`, temperature
    0): route A (6 blocks) and free it; route B (A's first block, 5 of its own), its prefill done; route A again.
    Returns the three picks' worker ids and the blocks each worker held before the last."""
    router = _router(policy)
    a = list(range(96))
    b = a[:16] + list(range(1000, 1080))
    first = router.route(WORKERS, token_ids=a, request_id="a", reserve=True, now=0.0).worker
    router.free("a")
    second = router.route(WORKERS, token_ids=b, request_id="b", reserve=True, now=1.0).worker
    router.sequences.mark_prefill_completed("b")
    blocks = dict(router.index.stats()[Tier.device].workers)
    third = router.route(WORKERS, token_ids=a, request_id="a2", reserve=True, now=2.0).worker
    return first[0], second[0], third[0], blocks


def test_lru_evicts_a_released_prompt_for_room_where_ttl_keeps_it() -> None:
    """1.6.1's `KvRouter` (probe): under TTL the repeat of A goes back to its worker, overlap 6; under LRU, B's 5
    new blocks on an 8-block rank evicted 3 of A's, A's worker would cost 14 (3 + 11) and A goes to the other."""
    first, second, third, blocks = _probe(CachePolicy.ttl)
    assert second == first and third == first and blocks == {(first, 0): 11}
    first, second, third, blocks = _probe(CachePolicy.lru)
    assert second == first and blocks == {(first, 0): 8} and third != first


def test_a_prompts_partial_block_holds_capacity_while_it_lives() -> None:
    """Probe 3: P is 7 full blocks and 3 tokens (8 of 8 with its private block), freed; Q is P's first block, one
    block of its own and 5 tokens: 9 of 8, so P's deepest block goes. Without Q's tail nothing goes."""
    p = list(range(115))
    for tail, kept in ((5, 6), (0, 7)):
        router = _router(CachePolicy.lru)
        worker = router.route(WORKERS[:1], token_ids=p, request_id="p", reserve=True, now=0.0).worker
        router.free("p")
        q = p[:16] + list(range(2000, 2016 + tail))
        router.route([worker], token_ids=q, request_id="q", reserve=True, now=1.0)
        assert router.index.find_matches(local_block_hashes(p, 16)).scores.get(worker) == kept, tail


def test_a_rank_with_no_capacity_falls_back_to_ttl() -> None:
    router = _router(CachePolicy.lru, capacity=None, ttl_s=10.0)
    router.route(WORKERS[:1], token_ids=list(range(32)), request_id="a", reserve=True, now=0.0)
    router.free("a")
    assert router.approx is not None and router.approx.lru is not None
    assert router.approx.lru.stats().ttl_ranks == 1 and router.approx.size() == 2
    router.tick(11.0)
    assert router.approx.size() == 0  # the timers fired, as in TTL mode


def test_a_route_that_books_nothing_records_nothing() -> None:
    router = _router(CachePolicy.lru)
    router.route(WORKERS, token_ids=list(range(64)), now=0.0)
    assert router.approx is not None and router.approx.size() == 0
