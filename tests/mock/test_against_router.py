"""Mock engines against a real router (issue 6): their ZMQ events feed a `kvctl serve` app in-process.

The router here is the real thing in the test's own loop: `Fleet` + `Streams` (real SUB/DEALER sockets)
+ `create_app`, served by uvicorn as `kvctl serve` serves it, its routes on the path a test asks for. Engines
are registered with `POST /v1/workers` from the first six keys of their `/v1/info`, exactly as an operator
would.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx
import pytest

from kvctl.core.events import Tier
from kvctl.core.events.engine_encode import FORMATS as ENGINE_FORMATS
from kvctl.core.names import DEFAULT_MODEL
from kvctl.mock.engine import MOCK_FORMATS, EngineConfig, Faults, MockEngine
from kvctl.mock.fleet import Fleet as EngineFleet
from kvctl.mock.fleet import fleet_configs
from kvctl.server.http.api import create_app
from kvctl.server.ingest.streams import Streams
from kvctl.server.state import Fleet
from tests.mock.conftest import generate, metric
from tests.support import eventually_async, joined
from tests.support.served import ROUTE_PATHS, served

ROUTER_BLOCK_SIZE = 16
SETTLE_S = 5.0
U64 = 2**64

BASE = EngineConfig(worker_id=1, model_name=DEFAULT_MODEL, block_size=ROUTER_BLOCK_SIZE, capacity=32,
                    speedup=100.0)
"""Engines with the router's block size, under the router's default model, 32 device blocks, fast."""


def prompt(prefix: int, suffix: int, blocks: int = 14, shared: int = 4) -> list[int]:
    """`shared` blocks common to every prompt of the same `prefix`, then `blocks - shared` blocks of its own."""
    head = [prefix * 1_000 + t for t in range(shared * ROUTER_BLOCK_SIZE)]
    tail = [100_000 + prefix * 10_000 + suffix * 1_000 + t for t in range((blocks - shared) * ROUTER_BLOCK_SIZE)]
    return head + tail


# Five 14-block prompts (4 shared) need 54 blocks: a 32-block cache evicts along the way.
PROMPTS = [prompt(1, s) for s in range(5)]


@dataclass
class Rig:
    client: httpx.AsyncClient
    streams: Streams
    engines: dict[int, MockEngine]
    url: str  # the router's, for another client (the load generator's)

    async def stream(self, worker_id: int) -> dict[str, Any]:
        """The router's `/v1/status` stream row of one worker."""
        status = (await self.client.get("/v1/status")).json()
        [row] = [s for s in status["streams"] if s["worker"]["worker_id"] == worker_id]
        return row

    async def until(self, worker_id: int, predicate: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
        """Poll a worker's stream row until `predicate` holds; fail with the row after SETTLE_S."""
        return await eventually_async(lambda: self.stream(worker_id), f"{what} of worker {worker_id}",
                                      until=predicate, timeout=SETTLE_S)

    async def settle(self) -> dict[int, dict[str, Any]]:
        """Wait until every stream has taken every batch its engine published and the index has applied them."""
        rows = {}
        for worker_id, engine in self.engines.items():
            published = engine.publisher.next_seq - 1 if engine.publisher and engine.publisher.next_seq else None
            rows[worker_id] = await self.until(
                worker_id, lambda s, p=published: s["last_seq"] == p and not s["replaying"], f"seq {published}")
        for writer in self.streams.writers.values():
            await writer.applied()
        return rows

    async def tree(self, worker_id: int) -> dict[int, int]:
        """The worker's device blocks in the router's index: tokens_hash -> engine block hash (as u64)."""
        params = {"worker": str(worker_id), "model": self.engines[worker_id].config.model_name}
        dump = (await self.client.get("/v1/tree", params=params)).json()
        return {b["tokens_hash"]: b["block_hash"] for ev in dump if ev["storage_tier"] == Tier.device.value
                for b in ev["event"]["data"]["stored"]["blocks"]}

    async def overlaps(self, tokens: Sequence[int]) -> dict[int, int]:
        """Overlap blocks per worker for a prompt, from `POST /v1/route` with `explain`."""
        response = await self.client.post("/v1/route", json={"token_ids": list(tokens), "explain": True})
        assert response.status_code == 200, response.text
        return {c["worker_id"]: c["overlap_blocks"] for c in response.json()["candidates"]}

    async def workers(self) -> dict[int, dict[str, Any]]:
        return {w["worker_id"]: w for w in (await self.client.get("/v1/workers")).json()["workers"]}


@contextlib.asynccontextmanager
async def rig(configs: Sequence[EngineConfig], route_path: str = ROUTE_PATHS[0]) -> AsyncIterator[Rig]:
    """Engines plus a router subscribed to each of them, routing on `route_path`; everything closed on the way
    out."""
    fleet = Fleet(block_size=ROUTER_BLOCK_SIZE)
    streams = Streams(fleet)
    async with contextlib.AsyncExitStack() as stack:
        engines = await stack.enter_async_context(EngineFleet(configs))
        client = await stack.enter_async_context(served(create_app(fleet, streams=streams), route_path))
        stack.push_async_callback(streams.close)  # closed first: the router lets go before the engines stop
        for info in engines.infos():
            response = await client.post("/v1/workers", json=dict(list(info.items())[:6]))
            assert response.status_code == 201, response.text
        await joined(engines.engines)  # the router's SUBs have joined: nothing published from here on is lost
        yield Rig(client, streams, {e.config.worker_id: e for e in engines.engines}, str(client.base_url))


def engine_blocks(engine: MockEngine) -> set[int]:
    """The engine's device cache content, as the u64 ids a router keeps (SGLang's are signed)."""
    return {h % U64 for h in engine.cache.contents(Tier.device)}


def chain(engine: MockEngine, tokens: Sequence[int]) -> list[int]:
    """The engine block hashes (u64) of a prompt's full blocks, as that engine computes them."""
    return [h % U64 for h, _ in engine.cache.hasher.chain(tokens, engine.block_size)]


async def run_all(engine: MockEngine, prompts: Sequence[Sequence[int]]) -> None:
    """Send prompts one after the other: each stores new blocks, so each publishes exactly one batch."""
    for tokens in prompts:
        lines = await generate(engine, list(tokens))
        assert lines[-1]["event"] == "done"


# ----- 1. every format is ingested cleanly and the index mirrors the engine ------------------------------


ZMQ_FORMATS = [fmt for fmt in MOCK_FORMATS if fmt in ENGINE_FORMATS]
FORMAT_CASES = [
    ("vllm", "map", ["u64"]),
    ("vllm-legacy", "array", ["u64"]),  # positional events
    ("sglang", "map", ["i64", "u64"]),  # signed hashes, about half of them negative
]


def test_every_engine_zmq_format_is_covered() -> None:
    assert [fmt for fmt, _, _ in FORMAT_CASES] == ZMQ_FORMATS


@pytest.mark.parametrize(("fmt", "event_shape", "hash_kinds"), FORMAT_CASES, ids=[c[0] for c in FORMAT_CASES])
async def test_each_format_is_ingested_without_errors_and_the_index_equals_the_cache(
    fmt: str, event_shape: str, hash_kinds: list[str]
) -> None:
    async with rig([replace(BASE, format=fmt)]) as r:
        engine = r.engines[1]
        await run_all(engine, PROMPTS)
        row = (await r.settle())[1]
        tree = await r.tree(1)
    assert row["decode_errors"] == {} and row["messages"] == len(PROMPTS) == row["batches_applied"]
    assert (row["gaps"], row["lost_batches"], row["gapped"]) == (0, 0, False)
    assert (row["schema"]["event_shapes"], row["schema"]["hash_kinds"]) == ([event_shape], hash_kinds)
    assert row["schema"]["block_sizes"] == [ROUTER_BLOCK_SIZE] and row["schema"]["tiers"] == ["device"]
    assert not set(chain(engine, PROMPTS[0])) <= engine_blocks(engine)  # something was evicted
    assert len(engine_blocks(engine)) == BASE.capacity
    assert set(tree.values()) == engine_blocks(engine)


# ----- 2. drop_every: the replay buffer repairs real gaps ------------------------------------------------


async def test_drop_every_gaps_are_repaired_from_the_replay_buffer() -> None:
    async with rig(fleet_configs(1, BASE, faults=Faults(drop_every=3))) as r:
        engine = r.engines[1]
        await run_all(engine, [*PROMPTS, prompt(2, 0), prompt(2, 1)])  # seqs 0..6; 2 and 5 never go out live
        row = (await r.settle())[1]
        tree = await r.tree(1)
    assert engine.publisher is not None and engine.publisher.next_seq == 7
    assert row["messages"] == 5 and row["batches_applied"] == 7
    assert (row["gaps"], row["replays_ok"], row["replays_failed"]) == (2, 2, 0)
    assert (row["lost_batches"], row["gapped"], row["decode_errors"]) == (0, False, {})
    assert set(tree.values()) == engine_blocks(engine)


# ----- 3. each fault knob shows the symptom it names ------------------------------------------------------


async def across_the_restart(r: Rig, engine: MockEngine, before: Sequence[Sequence[int]],
                             after: Sequence[Sequence[int]]) -> set[int]:
    """Send `before`, see them indexed, wait for the engine's `restart_after`, send `after`; returns the old blocks."""
    await run_all(engine, before)
    await r.settle()
    old = set((await r.tree(engine.config.worker_id)).values())
    assert engine.restarts == 0 and old == engine_blocks(engine), "the restart came too early for this test"
    while not engine.restarts:
        await asyncio.sleep(0.02)
    await run_all(engine, after)
    return old


async def test_restart_after_counts_a_restart_and_leaves_only_post_restart_blocks() -> None:
    after = [prompt(3, 0, blocks=6)]
    async with rig(fleet_configs(1, BASE, faults=Faults(restart_after=0.8))) as r:
        engine = r.engines[1]
        old = await across_the_restart(r, engine, PROMPTS[:2], after)  # seqs 0, 1, then 0 again
        row = await r.until(1, lambda s: s["restarts"] == 1 and s["last_seq"] == 0, "the restart")
        await r.settle()
        tree = await r.tree(1)
        metrics = (await r.client.get("/metrics")).text
    assert row["restarts"] == 1 and row["decode_errors"] == {} and not row["gapped"]
    assert set(tree.values()) == engine_blocks(engine) == set(chain(engine, after[0]))
    assert old.isdisjoint(tree.values())
    assert metric(metrics, "kvctl_stream_engine_restarts_total") == 1


async def test_a_restart_after_a_single_batch_is_still_detected() -> None:
    async with rig(fleet_configs(1, BASE, faults=Faults(restart_after=0.5))) as r:
        engine = r.engines[1]
        old = await across_the_restart(r, engine, PROMPTS[:1], PROMPTS[1:2])  # seq 0, then seq 0 again
        row = await r.until(1, lambda s: s["messages"] == 2, "the second message")
        await r.settle()
        tree = await r.tree(1)
    assert (row["restarts"], row["duplicates"]) == (1, 0)  # a PUB never sends a seq twice: seq 0 again is a restart
    assert set(tree.values()) == engine_blocks(engine) == set(chain(engine, PROMPTS[1]))
    assert old - engine_blocks(engine)  # pre-restart blocks the engine lost are gone from the index too


async def test_a_foreign_block_size_is_visible_in_the_schema_and_never_matches(route_path: str) -> None:
    configs = fleet_configs(2, BASE, faults=Faults(block_size=2 * ROUTER_BLOCK_SIZE), fault_engines=[1])
    tokens = prompt(4, 0, blocks=4, shared=4)
    async with rig(configs, route_path) as r:
        for engine in r.engines.values():
            await run_all(engine, [tokens])
        rows = await r.settle()
        overlaps = await r.overlaps(tokens)
        blocks = {w: len(await r.tree(w)) for w in r.engines}
    assert rows[1]["schema"]["block_sizes"] == [ROUTER_BLOCK_SIZE]
    assert rows[2]["schema"]["block_sizes"] == [2 * ROUTER_BLOCK_SIZE]
    assert rows[1]["decode_errors"] == rows[2]["decode_errors"] == {}
    assert blocks == {1: 4, 2: 0}  # as Dynamo's indexer: a store of another block size indexes nothing
    assert rows[2]["events_dropped"] == {"block_size_mismatch": 1} and rows[1]["events_dropped"] == {}
    assert overlaps == {1: 4, 2: 0}


async def test_nondeterministic_hash_engines_publish_different_hashes_for_the_same_tokens() -> None:
    # One model (one index) per engine: a shared index keeps one engine hash per block, the first it was
    # told (as Dynamo's tree does), so each engine's own hashes are only visible in an index of its own.
    configs = fleet_configs(4, replace(BASE, seed=11), faults=Faults(nondeterministic_hash=True), fault_engines=[2, 3])
    configs = [replace(c, model_name=f"model-{c.worker_id}") for c in configs]
    tokens = prompt(5, 0, blocks=6)
    async with rig(configs) as r:
        for engine in r.engines.values():
            await run_all(engine, [tokens])
        rows = await r.settle()
        trees = {w: await r.tree(w) for w in r.engines}
    assert all(row["decode_errors"] == {} for row in rows.values())
    assert all(set(trees[w].values()) == engine_blocks(e) and len(trees[w]) == 6 for w, e in r.engines.items())
    assert trees[1] == trees[2]  # healthy: the same tokens under the same engine block hashes
    assert trees[3].keys() == trees[1].keys() == trees[4].keys()  # the same tokens ...
    for tokens_hash, block_hash in trees[3].items():  # ... under three different engine block hashes
        assert len({block_hash, trees[4][tokens_hash], trees[1][tokens_hash]}) == 3


async def test_a_silent_engine_serves_but_the_router_sees_nothing() -> None:
    configs = fleet_configs(2, BASE, faults=Faults(silent=True), fault_engines=[1])
    async with rig(configs) as r:
        for engine in r.engines.values():
            await run_all(engine, PROMPTS[:2])
        rows = await r.settle()
        workers = await r.workers()
        async with httpx.AsyncClient(base_url=r.engines[2].url) as client:
            engine_metrics = (await client.get("/metrics")).text
    assert rows[2]["messages"] == 0 and rows[2]["events"] == 0 and rows[2]["last_event_age_s"] is None
    assert workers[2]["blocks"] == 0
    assert metric(engine_metrics, "vllm:prefix_cache_queries_total") == 2 * 14 * ROUTER_BLOCK_SIZE
    assert rows[1]["messages"] == 2 and workers[1]["blocks"] == len(engine_blocks(r.engines[1])) > 0


async def test_a_slow_engine_still_queues_when_a_healthy_one_has_drained() -> None:
    base = replace(BASE, max_running=1, speedup=10.0)
    configs = fleet_configs(2, base, faults=Faults(slow=True), fault_engines=[1])
    requests = [prompt(6, s, blocks=2, shared=0) for s in range(4)]
    async with rig(configs) as r:
        healthy, slow = r.engines[1], r.engines[2]
        in_flight = [asyncio.ensure_future(generate(slow, tokens, max_tokens=5)) for tokens in requests]
        try:  # 4 requests one at a time, (17 ms prefill + 4 x 6 ms decode) / 10 x 25 = 100 ms each on the slow engine
            await asyncio.gather(*(generate(healthy, tokens, max_tokens=5) for tokens in requests))
            loads = {w: await _load(e) for w, e in r.engines.items()}
        finally:
            done = await asyncio.gather(*in_flight)
        after = await _load(slow)
    assert loads[1] == (0, 0)  # the healthy engine drained
    running, waiting = loads[2]
    assert running == 1 and waiting >= 2  # the slow one still has one running, the rest queued
    assert after == (0, 0) and all(lines[-1]["event"] == "done" for lines in done)


async def _load(engine: MockEngine) -> tuple[float, float]:
    """(running, waiting) from an engine's own `/metrics`."""
    async with httpx.AsyncClient(base_url=engine.url) as client:
        text = (await client.get("/metrics")).text
    return metric(text, "vllm:num_requests_running"), metric(text, "vllm:num_requests_waiting")


# ----- Dynamo's semantics where engines disagree on hashes ---------------------------------------------


async def test_engines_hashing_the_same_tokens_differently_show_as_failed_removals(route_path: str) -> None:
    """Dynamo 1.6.1's tree keeps one engine hash per edge (the first writer's): a worker with other hashes for
    the same tokens cannot remove its blocks there (Dynamo itself fails with "Failed to find block"). kvctl
    keeps those semantics and makes the symptom visible: removals counted as block_not_found, and the
    evicted prefix still routed to that worker (a phantom hit, what `kvctl doctor` names)."""
    configs = fleet_configs(2, replace(BASE, seed=11, capacity=8), faults=Faults(nondeterministic_hash=True),
                            fault_engines=[1])
    shared = prompt(7, 0, blocks=4, shared=4)
    async with rig(configs, route_path) as r:
        for engine in r.engines.values():  # the healthy engine stores the shared prefix first
            await run_all(engine, [shared])
        await run_all(r.engines[2], [prompt(8, s, blocks=4, shared=0) for s in range(3)])  # and worker 2 evicts it
        await r.settle()
        metrics = (await r.client.get("/metrics")).text
        overlaps = await r.overlaps(shared)
    failed = [line for line in metrics.splitlines()
              if line.startswith("kvctl_kv_events_applied_total") and 'status="block_not_found"' in line]
    assert failed and float(failed[0].rsplit(" ", 1)[1]) > 0
    assert overlaps == {1: 4, 2: 4}  # worker 2 evicted the prefix, but the index still credits it
