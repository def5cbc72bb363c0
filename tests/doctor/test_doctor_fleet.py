"""`kvctl doctor` against a real router and real mock engines: each fault knob, named as its cause."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvctl import http_api as api
from kvctl.client import calls
from kvctl.client.engine import EngineClient
from kvctl.mock.engine import Faults
from tests.commands.live_router import free_port_url
from tests.doctor.rig import BASE, Rig, doctor, engines_behind_router, findings
from tests.server.test_serve_process import DUMP, _stop, serving
from tests.support import eventually_async


def severities(report: dict[str, object]) -> set[str]:
    return {f["severity"] for f in report["findings"]}  # type: ignore[attr-defined]


async def test_a_healthy_fleet_is_ok(tmp_path: Path) -> None:
    async with engines_behind_router(tmp_path) as rig:
        await rig.load()
        await rig.until(lambda ws: all(w.blocks for w in ws), "every engine's blocks")
        code, report = await rig.doctor()
    assert "CRITICAL" not in severities(report) and "WARNING" not in severities(report), report
    assert code == 0 and report["status"] == "OK"
    assert {f["check"] for f in report["findings"]} >= {"workers", "silent", "streams", "block_size", "hashing",
                                                        "busy", "index"}


def test_an_unreachable_router_is_critical_and_named() -> None:
    url = free_port_url()
    code, report = doctor(url)
    [finding] = report["findings"]
    assert code == 2 and finding["check"] == "router" and url in finding["cause"]


def test_a_router_without_workers_is_critical(tmp_path: Path) -> None:
    with serving(tmp_path, "--no-restore") as (_, client):
        code, report = doctor(str(client.base_url).rstrip("/"))
    [finding] = report["findings"]
    assert code == 2 and finding["check"] == "workers" and "no workers" in finding["cause"]


async def test_a_silent_engine_is_named(tmp_path: Path) -> None:
    async with engines_behind_router(tmp_path, faults=Faults(silent=True), fault_engines=[0]) as rig:
        await rig.load()
        await rig.until(lambda ws: sum(bool(w.blocks) for w in ws) == 2, "the other engines' blocks")
        code, report = await rig.doctor()
    [finding] = findings(report, "silent")
    assert code == 1 and finding["severity"] == "WARNING"
    assert finding["evidence"]["never"] == ["1:0"] and "1 of 3 workers silent" in finding["cause"]


async def test_engines_that_serve_but_never_publish_are_critical(tmp_path: Path) -> None:
    async with engines_behind_router(tmp_path, faults=Faults(silent=True)) as rig:  # kv events off everywhere
        await rig.load()
        code, report = await rig.doctor()
    [finding] = findings(report, "silent")
    assert code == 2 and finding["severity"] == "CRITICAL" and "3 of 3 workers silent" in finding["cause"]
    assert finding["evidence"]["never"] == ["1:0", "2:0", "3:0"]
    assert sum(signs["routes"] for signs in finding["evidence"]["serving"].values()) == 24  # every request routed


async def test_a_fleet_quiet_for_longer_than_silent_after_and_serving_nothing_is_idle_not_a_warning(
        tmp_path: Path) -> None:
    """It was "3 of 3 workers silent" WARNING: a quiet night paged someone."""
    async with engines_behind_router(tmp_path) as rig:
        await rig.load()
        await rig.until(lambda ws: all((w.last_event_age_s or 0) > 0.5 for w in ws), "every worker quiet 0.5 s")
        _, report = await rig.doctor("--silent-after", "0.5")
    [finding] = findings(report, "silent")
    assert finding["severity"] == "OK" and "3 of 3 workers silent" in finding["cause"], finding
    assert "an idle fleet" in finding["cause"] and finding["evidence"]["workers"] == ["1:0", "2:0", "3:0"]


async def test_a_block_size_mismatch_is_critical(tmp_path: Path) -> None:
    """Engine 2's 32-token blocks are not indexed (Dynamo's "Block not published"): doctor says why, twice."""
    async with engines_behind_router(tmp_path, faults=Faults(block_size=32), fault_engines=[1]) as rig:
        await rig.load()
        await rig.until(lambda ws: all(w.blocks for w in ws if w.worker_id != 2), "the other engines' blocks")
        await eventually_async(rig.status, "engine 2's stores dropped", until=lambda s: any(
            row["worker"]["worker_id"] == 2 and row["events_dropped"].get("block_size_mismatch")
            for row in s.streams))
        code, report = await rig.doctor()
        workers = {w.worker_id: w.blocks for w in await rig.until(lambda ws: True, "the workers")}
    [finding] = findings(report, "block_size")
    assert code == 2 and finding["severity"] == "CRITICAL"
    assert finding["evidence"]["block_sizes"] == {"2:0": {"engine": [32], "router": 16}}
    [dropped] = findings(report, "dropped")
    assert dropped["severity"] == "CRITICAL" and "block_size_mismatch" in dropped["cause"]
    assert dropped["evidence"]["emptied"] == ["2:0"] and workers[2] == 0


async def test_engines_hashing_differently_are_named(tmp_path: Path) -> None:
    async with engines_behind_router(tmp_path, faults=Faults(nondeterministic_hash=True)) as rig:
        await rig.load()
        await rig.until(lambda ws: any(w.hash_mismatches for w in ws), "a hash mismatch")
        code, report = await rig.doctor()
    [finding] = findings(report, "hashing")
    assert code == 2 and finding["severity"] == "CRITICAL" and "non-deterministic" in finding["cause"]
    assert finding["evidence"]["count"] >= 1 and all(n > 0 for n in finding["evidence"]["mismatched_blocks"].values())


async def test_one_engine_hashing_unlike_the_rest_is_named_alone(tmp_path: Path) -> None:
    # Four engines, the third with its own hash seed. Each of four shared prefixes is stored first by another
    # engine, then by the rest, one at a time: the odd engine disagrees with the first store of three prefixes,
    # each other engine only with the odd engine's first store of one.
    seeded = replace(BASE, seed=7)
    async with engines_behind_router(tmp_path, engines=4, faults=Faults(nondeterministic_hash=True),
                                     fault_engines=[2], base=seeded) as rig:
        engines = [EngineClient(e.url) for e in rig.fleet.engines]
        try:
            for first in range(4):
                prefix = [first * 1_000 + t for t in range(4 * BASE.block_size)]
                for k in range(4):
                    index = (first + k) % 4
                    await _generate(engines[index], prefix)
                    await rig.until(lambda ws, n=index + 1, b=4 * (first + 1): _blocks(ws, n) == b,
                                    f"engine {index + 1}'s prefix {first} indexed")
        finally:
            await asyncio.gather(*(e.aclose() for e in engines))
        code, report = await rig.doctor()
    [finding] = findings(report, "hashing")
    assert code == 2 and finding["severity"] == "CRITICAL"
    assert finding["evidence"]["mismatched_blocks"] == {"1:0": 4, "2:0": 4, "3:0": 12, "4:0": 4}
    assert finding["evidence"]["workers"] == ["3:0"] and "worker 3:0 hashes " in finding["cause"]
    assert finding["next_step"].startswith("worker 3's engine")


def _blocks(workers: list[api.Worker], worker_id: int) -> int:
    return next(w.blocks for w in workers if w.worker_id == worker_id)


async def test_batches_lost_without_a_replay_endpoint_are_named(tmp_path: Path) -> None:
    async with engines_behind_router(tmp_path, faults=Faults(drop_every=3), fault_engines=[0], replay=False) as rig:
        await rig.load()
        await eventually_async(lambda: _stream_of(rig, 1, lambda s: s["lost_batches"] > 0), "a lost batch")
        code, report = await rig.doctor()
    [finding] = findings(report, "streams")
    assert code == 1 and finding["severity"] == "WARNING" and finding["evidence"]["workers"] == ["1:0"]
    assert finding["evidence"]["replay_endpoint"] == {"1:0": None} and "router reset --worker 1" in finding["next_step"]


async def test_gaps_that_replay_repairs_are_not_a_problem(tmp_path: Path) -> None:
    async with engines_behind_router(tmp_path, faults=Faults(drop_every=3), fault_engines=[0]) as rig:
        await rig.load()
        await eventually_async(lambda: _stream_of(rig, 1, lambda s: s["replays_ok"] > 0), "a repaired gap")
        code, report = await rig.doctor()
    [finding] = findings(report, "streams")
    assert code == 0 and finding["severity"] == "OK" and "repaired by replay" in finding["cause"]


async def test_an_engine_restart_is_named(tmp_path: Path) -> None:
    # Engine 3 is fed and restarted by hand, so that neither the load's routing nor a timer decides whether the
    # router ever sees its seq go backwards.
    async with engines_behind_router(tmp_path) as rig:
        engine = EngineClient(rig.fleet.engines[2].url)
        try:
            await _generate(engine, list(range(64)))
            await eventually_async(lambda: _stream_of(rig, 3, lambda s: s["messages"] > 0), "engine 3's first events")
            await engine.restart()
            await _generate(engine, list(range(100, 164)))
        finally:
            await engine.aclose()
        await eventually_async(lambda: _stream_of(rig, 3, lambda s: s["restarts"] > 0), "the restart seen")
        code, report = await rig.doctor()
    [finding] = findings(report, "restarts")
    assert code == 1 and finding["evidence"]["restarts"] == {"3:0": 1}


async def test_a_cache_cleared_as_vllm_does_empties_that_worker_and_is_no_restart(tmp_path: Path) -> None:
    # What `mock load` and the demo do between phases: AllBlocksCleared in the engine's own stream, seq going on.
    async with engines_behind_router(tmp_path) as rig:
        engines = [EngineClient(e.url) for e in rig.fleet.engines]
        try:
            for engine in engines:
                await _generate(engine, list(range(64)))
            await rig.until(lambda ws: all(w.blocks == 4 for w in ws), "every engine indexed")
            await engines[2].clear_cache()
            await rig.until(lambda ws: _blocks(ws, 3) == 0, "worker 3 emptied")
            await _generate(engines[2], list(range(100, 164)))
            workers = await rig.until(lambda ws: _blocks(ws, 3) == 4, "worker 3's new blocks")
        finally:
            await asyncio.gather(*(e.aclose() for e in engines))
        code, report = await rig.doctor()
        status = await rig.status()
    assert _blocks(workers, 1) == _blocks(workers, 2) == 4  # a worker's Cleared is its own (Dynamo's semantics)
    assert [s["restarts"] for s in status.streams if s["worker"]["worker_id"] == 3] == [0]
    assert findings(report, "restarts") == [] and findings(report, "streams")[0]["severity"] == "OK"
    assert code == 0, report


async def test_a_fleet_that_is_all_busy_is_critical_and_names_the_threshold(tmp_path: Path) -> None:
    slow = replace(BASE, speedup=0.06)  # ~18 ms / 0.06 = 0.3 s of prefill per request: load piles up
    async with engines_behind_router(tmp_path, base=slow) as rig:
        await rig.router.send(calls.set_busy_thresholds("default", {"active_prefill_tokens_threshold": 1}))
        load = asyncio.create_task(rig.load(requests=30, concurrency=6))
        try:
            await rig.until(lambda ws: all(w.busy for w in ws), "every worker busy")
            code, report = await rig.doctor()
        finally:
            await load  # to the end: a cancelled load would leave engine streams open
    [finding] = findings(report, "busy")
    assert code == 2 and finding["severity"] == "CRITICAL" and "every worker" in finding["cause"]
    assert finding["evidence"]["thresholds"] == {"active_prefill_tokens_threshold": 1}
    assert finding["evidence"]["tripped_by"] == {"active_prefill_tokens": 3}
    assert "active_prefill_tokens over its threshold" in finding["cause"]


async def _generate(engine: EngineClient, tokens: list[int]) -> None:
    async for _ in engine.generate(tokens, max_tokens=1):
        pass


async def _stream_of(rig: Rig, worker_id: int, predicate: Callable[[dict[str, Any]], bool]) -> bool:
    status = await rig.status()
    return any(predicate(s) for s in status.streams if s["worker"]["worker_id"] == worker_id)


async def test_engines_hitting_their_cache_while_the_router_predicts_none_is_critical(tmp_path: Path) -> None:
    async with engines_behind_router(tmp_path, faults=Faults(block_size=32)) as rig:  # every engine: 32
        await rig.load()
        await eventually_async(rig.status, "every engine's 32-token stores dropped", until=lambda s: all(
            row["events_dropped"].get("block_size_mismatch") for row in s.streams))
        code, report = await rig.doctor(*(arg for e in rig.fleet.engines for arg in ("--metrics", e.url)))
    [finding] = findings(report, "hit_rate")
    assert code == 2 and finding["severity"] == "CRITICAL"
    assert finding["evidence"]["router_predicted"] == 0 and finding["evidence"]["engines_mean"] >= 0.3
    [dropped] = findings(report, "dropped")  # and why: nothing is indexed, as Dynamo indexes nothing of them
    assert dropped["severity"] == "CRITICAL" and sorted(dropped["evidence"]["emptied"]) == ["1:0", "2:0", "3:0"]


async def test_a_healthy_fleet_s_hit_rates_agree(tmp_path: Path) -> None:
    async with engines_behind_router(tmp_path) as rig:
        await rig.load()
        code, report = await rig.doctor(*(arg for e in rig.fleet.engines for arg in ("--metrics", e.url)))
    [finding] = findings(report, "hit_rate")
    assert finding["severity"] == "OK" and finding["evidence"]["router_predicted"] > 0


def test_a_router_restarted_on_another_fleet_names_the_state_dirs_workers(tmp_path: Path) -> None:
    """Walking the README (issue 37), a router restarted with another configuration on the same state dir showed
    the old fleet's workers with a last event a few seconds ago, and doctor said "every worker sent events":
    they were restored, and nothing this router follows spoke for them."""
    with serving(tmp_path) as (proc, client):
        client.post("/v1/events", content=DUMP, headers={"content-type": "application/x-ndjson"})
        old = {(w["worker_id"], w["dp_rank"]) for w in client.get("/v1/workers").json()["workers"]}
        _stop(proc)
    engine = f"9=tcp://127.0.0.1:{free_port_url().rsplit(':', 1)[1]}"  # this configuration's one engine, idle
    with serving(tmp_path, "--worker", engine) as (proc, client):
        url = str(client.base_url).rstrip("/")
        rows = {(w["worker_id"], w["dp_rank"]): w for w in client.get("/v1/workers").json()["workers"]}
        assert {i for i, w in rows.items() if w["restored"]} == old and all(
            rows[i]["last_event_age_s"] is None for i in old), rows
        code, report = doctor(url)
        orphaned, idle = findings(report, "silent")
        assert code == 1 and orphaned["severity"] == "WARNING" and "known only from the state dir" in orphaned["cause"]
        assert orphaned["evidence"]["count"] == len(old) and orphaned["evidence"]["blocks"] > 0
        assert orphaned["next_step"].startswith("kvctl router reset --worker")
        assert idle["severity"] == "OK" and idle["evidence"]["workers"] == ["9:0"]  # the configured one is idle
        assert "1 of 1 workers silent" in idle["cause"]
        first = min(old)
        client.post("/v1/events", content=_one_event(first[0]), headers={"content-type": "application/x-ndjson"})
        row = next(w for w in client.get("/v1/workers").json()["workers"] if (w["worker_id"], w["dp_rank"]) == first)
        assert not row["restored"] and row["last_event_age_s"] is not None  # heard from: alive again
        _stop(proc)


def _one_event(worker_id: int) -> str:
    """The dump's first line, re-addressed to `worker_id`: an event of this run."""
    line = json.loads(DUMP.splitlines()[0])
    line["worker_id"] = worker_id
    return json.dumps(line) + "\n"
