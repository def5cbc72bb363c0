"""End to end: a real engine-side PUB/ROUTER publishing vLLM's captured payloads into a `kvctl serve`
process; what the router's /v1/tree shows must be exactly what the engine stored."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq.asyncio

from kvctl.core.hashing import local_block_hashes
from tests.fixtures_path import FIXTURES
from tests.server.zmq_engine import Engine
from tests.support import eventually_async

VLLM = FIXTURES / "vllm-0.33"
MESSAGES = {m["file"][0]: m for m in json.loads((VLLM / "manifest.json").read_text())["messages"]}


def payload(case: str) -> bytes:
    return (VLLM / MESSAGES[case]["file"]).read_bytes()


def stored_blocks(case: str) -> set[tuple[int, int]]:
    """(engine block hash, local hash) of every block a fixture message stores, from its manifest."""
    out = set()
    for ev in MESSAGES[case]["decoded_expectation"]["events"]:
        if ev["type"] == "BlockStored":
            local = local_block_hashes(ev["token_ids"], ev["block_size"], lora_name=ev["lora_name"])
            out |= {(h % 2**64, t) for h, t in zip(ev["block_hashes"], local, strict=True)}
    return out


def tree_blocks(dump: list[dict[str, Any]]) -> set[tuple[int, int]]:
    return {(b["block_hash"], b["tokens_hash"]) for ev in dump for b in ev["event"]["data"]["stored"]["blocks"]}


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    ctx = zmq.asyncio.Context()
    eng = Engine(ctx)
    yield eng
    await eng.close()
    ctx.term()


def _settled(status: dict[str, Any]) -> bool:
    """Everything the stream has taken is in the index: nothing left with the decoder or the writer (the
    stream's own counters move when a batch is taken, before a decode process has answered for it)."""
    return status["decoder"].get("in_flight", 0) == 0 and all(q["queued"] == 0 for q in status["queues"])


async def _until(predicate, client: httpx.AsyncClient, what: str, timeout: float = 10.0) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """The stream's status once `predicate` holds of it and everything it took has been applied."""
    async def status() -> dict[str, Any]:
        return (await client.get("/v1/status")).json()  # type: ignore[no-any-return]

    settled = await eventually_async(status, what, until=lambda s: predicate(s["streams"][0]) and _settled(s),
                                     timeout=timeout)
    return settled["streams"][0]  # type: ignore[no-any-return]


@asynccontextmanager
async def serving(engine: Engine, state_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    """`kvctl serve` following `engine` (stream and replay) with `state_dir`, its client once it is subscribed
    and ready; stopped with SIGTERM at the end, which must exit 0."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvctl", "serve", "--listen", "127.0.0.1:0", "--state-dir", str(state_dir),
        "--worker", f"1={engine.endpoint},replay={engine.replay_endpoint}",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = (await proc.stdout.readline()).decode().strip()  # type: ignore[union-attr]
        async with httpx.AsyncClient(base_url=url, timeout=5) as client:
            await engine.subscribed()  # the router's SUB is connected: nothing sent from now on is lost
            yield client
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_engine_events_gap_replay_restart_and_garbage(engine: Engine, tmp_path: Path) -> None:
    async with serving(engine, tmp_path) as client:
        await engine.publish(0, payload("a"))
        # seq 1 never goes out live: seq 2 reveals the gap and the router replays it from the ROUTER.
        await engine.publish(1, payload("b"), live=False)
        await engine.publish(2, payload("h"))
        await _until(lambda s: s["replays_ok"] == 1 and s["last_seq"] == 2, client, "the replay")
        assert tree_blocks((await client.get("/v1/tree")).json()) == (
            stored_blocks("a") | stored_blocks("b") | stored_blocks("h"))
        # A malformed message is counted and skipped; the stream goes on.
        await engine.publish(3, b"\xc1 not msgpack")
        await engine.publish(4, payload("i"))
        s = await _until(lambda s: s["last_seq"] == 4, client, "seq 4")
        assert s["decode_errors"] == {"bad_msgpack": 1} and s["gaps"] == 1 and not s["gapped"]
        assert s["events_per_s"] >= 0 and s["last_event_age_s"] is not None
        # seq back to 0: the engine restarted; its old blocks are cleared, the new one applied.
        await engine.publish(0, payload("l"))
        await _until(lambda s: s["restarts"] == 1, client, "the restart")
        dump = (await client.get("/v1/tree")).json()
        assert tree_blocks([e for e in dump if e["storage_tier"] == "device"]) == set()
        assert tree_blocks(dump) == stored_blocks("l")  # l is a CPU-tier store
        assert {e["storage_tier"] for e in dump} == {"host_pinned"}
        metrics = (await client.get("/metrics")).text
        where = f'dp_rank="0",endpoint="{engine.endpoint}"'
        assert f'kvctl_stream_decode_errors_total{{{where},kind="bad_msgpack",worker_id="1"}} 1.0' in metrics
        assert f'kvctl_stream_engine_restarts_total{{{where},worker_id="1"}} 1.0' in metrics
        workers = (await client.get("/v1/workers")).json()["workers"]
        assert [(w["worker_id"], w["endpoint"]) for w in workers] == [(1, engine.endpoint)]


async def test_a_restarted_router_asks_the_replay_for_what_it_missed(engine: Engine, tmp_path: Path) -> None:
    """Stopped and started again on its state dir, the router resumes the stream after the seq its index holds:
    it asks the engine's replay for seq 2 on, what was published while it was down (a removal of blocks it
    held, then a store), and ends with the engine's index, not the one it stopped with."""
    async with serving(engine, tmp_path) as client:
        await engine.publish(0, payload("a"))
        await engine.publish(1, payload("b"))
        await _until(lambda s: s["last_seq"] == 1, client, "seq 1")
    await engine.publish(2, payload("c"), live=False)  # removes b's two blocks
    await engine.publish(3, payload("h"), live=False)
    async with serving(engine, tmp_path) as client:
        s = await _until(lambda s: s["last_seq"] == 3 and not s["replaying"], client, "the catch-up")
        assert engine.requests == [2]
        assert (s["resumed_from"], s["replays_ok"], s["lost_batches"], s["gaps"]) == (1, 1, 0, 0)
        assert tree_blocks((await client.get("/v1/tree")).json()) == stored_blocks("a") | stored_blocks("h")
        await engine.publish(4, payload("i"))
        s = await _until(lambda s: s["last_seq"] == 4, client, "seq 4, live")
        assert (engine.requests, s["gaps"], s["restarts"]) == ([2], 0, 0)
