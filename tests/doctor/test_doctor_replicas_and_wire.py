"""`kvctl doctor` on what a mock fleet cannot show: diverging replicas, garbage on the wire, an overflowing
queue, an approximate index at its cap, a declared model nobody serves."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import nats
import zmq.asyncio

from kvctl.core.events import RouterEvent
from kvctl.core.events.plane import PlaneNames
from kvctl.nats.barrier import barrier
from tests.commands.live_router import DUMP
from tests.doctor.rig import doctor, findings
from tests.fixtures_path import FIXTURES
from tests.nats_server import NatsServer
from tests.server.test_nats_plane import envelope, store
from tests.server.test_serve_process import serving
from tests.server.zmq_engine import Engine
from tests.support.served import on_both_route_paths

VLLM = FIXTURES / "vllm-0.33"
LEGACY = FIXTURES / "vllm-legacy" / "0.23.0"
PAYLOADS = [(VLLM / m["file"]).read_bytes() for m in json.loads((VLLM / "manifest.json").read_text())["messages"]]


def _load(client: object, body: str) -> None:
    answer = client.post("/v1/events", content=body, headers={"content-type": "application/x-ndjson"})  # type: ignore[attr-defined]
    assert answer.json()["rejected"] == {}


def test_a_replica_that_missed_events_is_named_and_an_equal_one_is_ok(tmp_path: Path) -> None:
    extra = json.loads(DUMP.splitlines()[0])
    extra["worker_id"] = 77  # the same blocks on a worker only replica B heard of
    with serving(tmp_path / "a", "--no-restore") as (_, a), serving(tmp_path / "b", "--no-restore") as (_, b), \
            serving(tmp_path / "c", "--no-restore") as (_, c):
        for client in (a, b, c):
            _load(client, DUMP)
        _load(b, json.dumps(extra))
        url = str(a.base_url).rstrip("/")
        peer_b, peer_c = str(b.base_url).rstrip("/"), str(c.base_url).rstrip("/")
        code, report = doctor(url, "--peer", peer_b, "--peer", peer_c)
    by_peer = {f["evidence"]["peer"]: f for f in findings(report, "divergence")}
    assert code == 1 and by_peer[peer_c]["severity"] == "OK"
    diverged = by_peer[peer_b]
    assert diverged["severity"] == "WARNING" and [w["worker"] for w in diverged["evidence"]["workers"]] == ["77:0"]
    assert diverged["evidence"]["workers"][0]["only_b"] > 0 and f"tree diff {url} {peer_b}" in diverged["next_step"]


async def doctor_until(url: str, check: str, matches: Callable[[dict[str, Any]], bool] = lambda _: True,
                       ) -> tuple[int, dict[str, Any]]:
    """Run doctor until it reports a `check` finding that `matches` (the router takes events in its own time)."""
    for _ in range(100):
        code, report = await asyncio.to_thread(doctor, url)
        if any(matches(f) for f in findings(report, check)):
            return code, report
        await asyncio.sleep(0.05)
    raise AssertionError(f"doctor never reported {check!r}: {report}")


async def doctor_after_publishing(tmp_path: Path, payloads: list[bytes], finding: str, *serve_args: str,
                                  unsent: frozenset[int] = frozenset(), mute: bool = False,
                                  matches: Callable[[dict[str, Any]], bool] = lambda _: True,
                                  ) -> tuple[int, dict[str, Any]]:
    """A router subscribed to one real ZMQ engine (worker 5, its replay endpoint registered) that publishes
    `payloads` as seqs 0, 1, ... (those in `unsent` only into its replay buffer: a gap); doctor is run until it
    reports a `finding` that `matches`. A `mute` engine never answers replay requests."""
    ctx = zmq.asyncio.Context()
    engine = Engine(ctx, mute=mute)
    try:
        with serving(tmp_path, "--no-restore", *serve_args) as (_, client):
            worker = {"worker_id": 5, "endpoint": engine.endpoint, "replay_endpoint": engine.replay_endpoint}
            assert client.post("/v1/workers", json=worker).status_code == 201
            await engine.subscribed()
            for seq, payload in enumerate(payloads):
                await engine.publish(seq, payload, live=seq not in unsent)
            return await doctor_until(str(client.base_url).rstrip("/"), finding, matches)
    finally:
        await engine.close()
        ctx.term()


async def test_an_engine_sending_undecodable_batches_is_named_with_its_schema(tmp_path: Path) -> None:
    code, report = await doctor_after_publishing(tmp_path, [b"\xc1 not msgpack"] * 3, "decode")
    [finding] = findings(report, "decode")
    assert finding["severity"] == "WARNING" and finding["evidence"]["decode_errors"] == {"5:0": {"bad_msgpack": 3}}
    assert finding["next_step"].startswith("kvctl events tail --zmq tcp://127.0.0.1:")  # the engine's own endpoint
    [silent] = findings(report, "silent")  # nothing it sent could be used: the only worker never delivered
    assert code == 2 and silent["severity"] == "CRITICAL" and silent["evidence"]["never"] == ["5:0"]


async def test_bad_events_in_a_legacy_array_batch_are_named_with_the_schema_seen(tmp_path: Path) -> None:
    ts, events, dp_rank = msgspec.msgpack.decode((LEGACY / "a_block_stored_4x16.msgpack").read_bytes())
    events[0][3][5] = 2**32  # vLLM 0.23's positional token_ids, one outside u32
    good = (LEGACY / "b_block_stored_chained.msgpack").read_bytes()
    code, report = await doctor_after_publishing(tmp_path, [msgspec.msgpack.encode([ts, events, dp_rank]), good],
                                                 "decode")
    [finding] = findings(report, "decode")
    assert code == 1 and finding["evidence"]["decode_errors"] == {"5:0": {"bad_tokens": 1}}
    schema = finding["evidence"]["schema_seen"]["5:0"]
    assert (schema["batch_shapes"], schema["event_shapes"], schema["hash_kinds"]) == (["array"], ["array"], ["u64"])


async def test_a_replay_that_fails_is_named_with_the_lost_batches(tmp_path: Path) -> None:
    code, report = await doctor_after_publishing(tmp_path, PAYLOADS[:3], "streams", unsent=frozenset({1}), mute=True,
                                                 matches=lambda f: f["severity"] == "WARNING")
    [finding] = [f for f in findings(report, "streams") if f["severity"] == "WARNING"]
    assert code == 1 and "1 whose replays failed" in finding["cause"]
    assert finding["evidence"]["replays_failed"] == {"5:0": 1} and finding["evidence"]["lost_batches"] == {"5:0": 1}
    assert "replay buffer" in finding["next_step"]


@on_both_route_paths
def test_an_approximate_index_at_its_cap_is_named(tmp_path: Path) -> None:
    with serving(tmp_path, "--no-restore", "--approximate", "--max-tree-size", "100") as (_, client):
        for worker_id in (1, 2):
            assert client.post("/v1/workers", json={"worker_id": worker_id}).status_code == 201
        for n in range(46):  # 2 blocks a route: 92 of the 100 (worker, block) pairs the cap allows
            request = {"token_ids": [n * 1000 + t for t in range(32)], "request_id": f"r{n}", "reserve": True}
            assert client.post("/v1/route", json=request).status_code == 200
            client.delete(f"/v1/requests/r{n}")
        code, report = doctor(str(client.base_url).rstrip("/"))
    [finding] = [f for f in findings(report, "index") if "approximate-mode cap" in f["cause"]]
    assert code == 1 and finding["evidence"] == {"model": "default", "blocks": 92, "max_tree_size": 100}


async def test_a_burst_past_a_tiny_writer_queue_is_held_back_and_doctor_finds_nothing_dropped(tmp_path: Path) -> None:
    """2,000 batches into a 1-batch writer queue: the stream stops reading while the writer is behind (ZMQ
    holds the rest), so every batch is applied and doctor has no dropped events to report. (Its queues
    check itself, which a NATS or future source could still trip, is covered in test_checks.py.)"""
    burst = [PAYLOADS[n % len(PAYLOADS)] for n in range(2_000)]
    ctx = zmq.asyncio.Context()
    engine = Engine(ctx)
    try:
        with serving(tmp_path, "--no-restore", "--queue-batches", "1") as (_, client):
            worker = {"worker_id": 5, "endpoint": engine.endpoint, "replay_endpoint": engine.replay_endpoint}
            assert client.post("/v1/workers", json=worker).status_code == 201
            await engine.subscribed()
            for seq, payload in enumerate(burst):
                await engine.publish(seq, payload)
            for _ in range(400):
                status = client.get("/v1/status").json()
                if status["streams"][0]["batches_applied"] == len(burst):
                    break
                await asyncio.sleep(0.05)
            assert status["streams"][0]["batches_applied"] == len(burst), status["streams"][0]
            assert (status["queues"][0]["capacity"], status["queues"][0]["dropped_batches"]) == (1, 0)
            assert status["streams"][0]["gaps"] == 0
            _, report = await asyncio.to_thread(doctor, str(client.base_url).rstrip("/"))
    finally:
        await engine.close()
        ctx.term()
    assert findings(report, "queues") == []
    [index] = findings(report, "index")
    assert "no queue dropped events" in index["cause"]


def test_a_declared_model_without_workers_is_named(tmp_path: Path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text('[[models]]\nname = "llama"\nblock_size = 32\n')
    with serving(tmp_path, "--no-restore", "--config", str(config)) as (_, client):
        _load(client, DUMP)  # the default model's workers
        code, report = doctor(str(client.base_url).rstrip("/"))
    [finding] = findings(report, "workers")
    assert code == 1 and finding["severity"] == "WARNING" and finding["evidence"]["models_without_workers"] == ["llama"]


async def _doctor_on_a_plane(tmp_path: Path, plane: tuple[str, ...], sent: list[tuple[RouterEvent, int]],
                             severity: str) -> tuple[int, dict[str, Any]]:
    """A router following a NATS plane (`--nats URL` and `plane`), kv-events envelopes `sent` as (event, sequence)
    onto the `doc` namespace's backend, then doctor until its event_plane finding has `severity`."""
    nats_server = NatsServer(tmp_path / "nats")
    try:
        with serving(tmp_path / "router", "--no-restore", "--nats", nats_server.url, *plane) as (_, client):
            await _plane_ready(client)
            nc = await nats.connect(nats_server.url)
            try:
                for ev, seq in sent:
                    await nc.publish(PlaneNames("doc").kv_events, envelope(ev, seq))
                await barrier(nc)
            finally:
                await nc.close()
            code, report = await doctor_until(str(client.base_url).rstrip("/"), "event_plane",
                                              lambda f: f["severity"] == severity)
    finally:
        nats_server.stop()
    [finding] = findings(report, "event_plane")
    return code, finding


async def test_events_lost_on_the_nats_event_plane_are_named(tmp_path: Path) -> None:
    tokens = list(range(48))
    # envelopes 1 and 2 (event ids 2 and 3) never come
    sent = [(store(5, 1, tokens[:32]), 0), (store(5, 4, tokens[32:48]), 3)]
    code, finding = await _doctor_on_a_plane(tmp_path, ("--namespace", "doc"), sent, "WARNING")
    assert code == 1 and "lost 2 messages" in finding["cause"] and "2 KV events" in finding["cause"]
    assert finding["evidence"]["publishers"] == [{"publisher_id": 77, "topic": "kv-events", "lost": 2,
                                                  "workers": ["5:0"]}]


async def test_a_plane_that_carries_nothing_in_scope_names_the_subjects_it_does_carry(tmp_path: Path) -> None:
    # the fleet's workers are in component backend, not prefill
    code, finding = await _doctor_on_a_plane(tmp_path, ("--namespace", "doc", "--component", "prefill"),
                                             [(store(5, 1, list(range(32))), 0)], "CRITICAL")
    assert code == 2 and finding["cause"].startswith(
        "0 messages on namespace.doc.component.prefill.endpoint.*.kv-events in ")
    assert finding["evidence"]["subjects_seen"] == {PlaneNames("doc").kv_events: 1}
    assert "--component" in finding["next_step"]


async def _plane_ready(client: Any) -> None:
    for _ in range(200):
        if (client.get("/v1/status").json()["event_plane"] or {}).get("ready"):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the event plane never became ready")
