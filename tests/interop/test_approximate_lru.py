"""Approximate LRU (`--router-approximate-cache-policy lru`, issue 38) against Dynamo 1.6.1's own router.

1.6.1's `SelectionService` cannot arbitrate it: asked for lru it warns and falls back to TTL retention. Its
`KvRouter` (the Python binding the frontend's router is) does run it, so it is the arbiter here: two mockers of 8
KV blocks each, found through the fleet's file discovery (their cards give the capacity), and the same steps
through the KvRouter and through kvctl's router. A prompt A of 6 blocks is routed and freed; a prompt B sharing
A's first block is routed (its prefill done); A again: under TTL it goes back to A's worker, under LRU B's blocks
evicted 3 of A's (the deepest, oldest release first), and it goes to the other worker."""

from __future__ import annotations

import json
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvctl.core.router.approx import ApproxConfig, ApproxIndexer
from kvctl.core.router.approx_lru import CachePolicy
from kvctl.core.router.router import Router
from tests.interop.fleet import Fleet, write_model_dir

CAPACITY = 8
POLLING = Path(__file__).parents[1] / "support" / "eventually.py"  # eventually_async, for the Dynamo-venv script
A = list(range(1000, 1096))  # 6 blocks
B = A[:16] + list(range(5000, 5080))  # A's first block, 5 of its own
STEPS: list[tuple[str, str, list[int]]] = [
    ("route", "a", A), ("free", "a", []), ("route", "b", B), ("prefill", "b", []), ("route", "a2", A)]

KV_ROUTER = r'''
import asyncio, json, runpy, sys
import dynamo._core as core

# The tests' one polling loop (tests/support/eventually.py, stdlib only), loaded by path: this runs in Dynamo's venv.
eventually_async = runpy.run_path(sys.argv[4])["eventually_async"]


async def main():
    policy, workers, steps = sys.argv[1], set(json.loads(sys.argv[2])), json.loads(sys.argv[3])
    runtime = core.DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
    config = core.KvRouterConfig(use_kv_events=False, router_approximate_cache_policy=policy,
                                 router_temperature=0.0)
    router = core.KvRouter(runtime.endpoint("dyn://dynamo.backend.generate"), 16, config)

    async def known():
        return {load["worker_id"] for load in await router.get_potential_loads(list(range(16)))}

    await eventually_async(known, "the KvRouter knowing both workers from discovery (their cards: the capacity)",
                           until=lambda seen: seen >= workers)
    picks = []
    for op, request_id, tokens in steps:
        if op == "route":
            worker, _, overlap = await router.best_worker(tokens, request_id=request_id, update_indexer=True)
            picks.append([worker, overlap])
        elif op == "free":
            await router.free(request_id)
        else:
            await router.mark_prefill_complete(request_id)
    print(json.dumps(picks), flush=True)
    runtime.shutdown()

asyncio.run(main())
'''


@pytest.fixture(scope="module")
def small_workers(dynamo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Two aggregated mockers of 8 KV blocks, no frontend: the KvRouter under test is the only router."""
    workdir = tmp_path_factory.mktemp("interop-lru")
    (workdir / "home").mkdir()
    fleet = Fleet(workdir=workdir, python=dynamo, nats_url=None, namespace="dynamo",
                  model_dir=write_model_dir(workdir / "model"))
    try:
        for _ in range(2):
            fleet.start_mocker("agg", "--num-gpu-blocks-override", str(CAPACITY))
        for mocker in fleet.mockers:
            fleet.await_mocker(mocker)
        yield fleet
    finally:
        fleet.stop()


def _dynamo_picks(fleet: Fleet, policy: CachePolicy) -> list[list[Any]]:
    workers = json.dumps([m.worker_id for m in fleet.mockers])
    done = subprocess.run([str(fleet.python), "-c", KV_ROUTER, policy.value, workers, json.dumps(STEPS),
                           str(POLLING)],
                          env=fleet.env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    picks: list[list[Any]] = json.loads(done.stdout.splitlines()[-1])
    return picks


def _kvctl_picks(workers: list[int], policy: CachePolicy, first: int) -> list[list[Any]]:
    """The same steps through kvctl's router, its first (tied) pick made the one Dynamo made at random."""
    approx = ApproxIndexer(ApproxConfig(policy=policy), capacity=lambda _: CAPACITY)
    router = Router(block_size=16, approx=approx, rng=random.Random(0))
    picks = []
    for op, request_id, tokens in STEPS:
        if op == "route":
            candidates = [(first, 0)] if not picks else [(w, 0) for w in workers]
            decision = router.route(candidates, token_ids=tokens, request_id=request_id, reserve=True, now=0.0)
            picks.append([decision.worker[0], decision.overlap_blocks])
        elif op == "free":
            router.free(request_id)
        else:
            router.sequences.mark_prefill_completed(request_id)
    return picks


@pytest.mark.parametrize("policy", list(CachePolicy))
def test_lru_and_ttl_pick_as_dynamos_kv_router(small_workers: Fleet, policy: CachePolicy) -> None:
    theirs = _dynamo_picks(small_workers, policy)
    ours = _kvctl_picks([m.worker_id for m in small_workers.mockers], policy, first=theirs[0][0])
    assert ours == theirs, (policy, ours, theirs)
    first, _, again = theirs
    assert (again[0] == first[0]) is (policy is CachePolicy.ttl), theirs  # the scenario tells the policies apart
