"""The pack against the real thing: a Prometheus (rules loaded, minutes read as seconds: tests/monitoring/pack.py)
scrapes a `kvctl serve` fed by mock engines, a second one in approximate mode, the engines, an exporter of every
tier family and a Dynamo frontend's captured metrics. Then the faults are switched on, one per alert: the mock
engines' (silent, drop-every without replay, another block size, a restart), every worker of a model busy,
blocks claimed for a worker that never stored them, an endpoint publishing junk, the approximate index filled
past its cap, that router's process held (SIGSTOP) a fifth of the time, and multi-turn chats routed by a third
router that gives cached blocks no credit (`--overlap-score-credit 0`: its decision audit finds the cache missed
and ignored). Each alert must go pending (or
firing) on the worker or model its fault hit; then every recording rule and every dashboard query must return
data, and every dashboard variable must resolve. Replica divergence is left to promtool's unit tests: two
replicas scraped a second apart differ by the events of that second, which at a test's few hundred blocks is
over the 1 % the alert allows.

`pytest -s` prints the time from each fault to its alert going pending."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import zmq
import zmq.asyncio

from kvctl.mock.engine import Faults
from kvctl.mock.fleet import Fleet
from tests.doctor.rig import BASE
from tests.monitoring.dynamo_frontend import DynamoFrontend
from tests.monitoring.pack import Prom, dashboard, panel_queries, recorded, scaled_rules, variable_lookups
from tests.server.test_api import _store_event
from tests.server.test_serve_process import serving
from tests.support import joined
from tests.tiers.exporter import TierExporter
from tests.tiers.prometheus_server import prometheus, wait_for_scrapes

SILENT, DROPPING, RESTARTING, MISMATCHED, CROWDED, HAUNTED, JUNK = 3, 4, 1, 5, 6, 7, 9
ENGINES = {1: Faults(), 2: Faults(), SILENT: Faults(silent=True), DROPPING: Faults(drop_every=2),
           MISMATCHED: Faults(block_size=32), CROWDED: Faults(), HAUNTED: Faults()}
APPROX_CAP = 64
BLIND_WORKERS = (1, 2, 3)
PENDING_TIMEOUT_S = 40.0
PREFIXES = [list(range(1000 * p, 1000 * p + 64)) for p in range(3)]


@dataclasses.dataclass
class Rig:
    router: httpx.AsyncClient
    approx: httpx.AsyncClient
    blind: httpx.AsyncClient  # credit 0: its own picks ignore the cache
    fleet: Fleet
    junk: zmq.asyncio.Socket  # bound; silent until `publish_junk`
    junk_endpoint: str
    running: bool = True
    haunted: bool = False  # from the fault on, every prompt of model "haunted" is claimed stored before it is routed

    def engine(self, worker_id: int) -> Any:
        return next(e for e in self.fleet.engines if e.config.worker_id == worker_id)

    async def register(self, worker_id: int, model: str, *, replay: bool = False,
                       endpoint: str | None = None) -> None:
        info = self.engine(worker_id).info() if endpoint is None else {"endpoint": endpoint, "replay_endpoint": None}
        body = {"worker_id": worker_id, "model": model, "endpoint": info["endpoint"],
                "replay_endpoint": info["replay_endpoint"] if replay else None}
        answer = await self.router.post("/v1/workers", json=body)
        assert answer.status_code == 201, answer.text

    async def drive(self, model: str, prompt: Any, lane: str = "") -> None:
        """Requests through the router's whole life cycle, the engine's cached tokens passed at prefill_complete,
        until the test ends. A refused route (all busy, no worker yet) waits a little and tries again."""
        n = 0
        while self.running:
            n += 1
            request_id, tokens = f"{model}-{lane}{n}", prompt()
            if model == "haunted" and self.haunted:  # blocks the engine never stored, in the router's index
                await self.router.post("/v1/events", params={"model": model}, json=[_store_event(HAUNTED, tokens)])
            routed = await self.router.post("/v1/route", json={"model": model, "token_ids": tokens,
                                                               "request_id": request_id, "reserve": True})
            if routed.status_code != 200:
                await asyncio.sleep(0.1)
                continue
            url = self.engine(routed.json()["worker_id"]).url
            async with httpx.AsyncClient(base_url=url, timeout=5) as engine:
                lines = (await engine.post("/v1/generate", json={"token_ids": tokens, "max_tokens": 2})).text
            cached = next(int(line.split('"cached_tokens": ')[1].split(",")[0].rstrip("}"))
                          for line in lines.splitlines() if '"first_token"' in line)
            await self.router.post(f"/v1/requests/{request_id}/prefill_complete", params={"model": model},
                                   json={"cached_tokens": cached})
            await self.router.delete(f"/v1/requests/{request_id}", params={"model": model})
            await asyncio.sleep(0.02)

    async def fill_approx(self) -> None:
        """Routes of new prompts through the approximate-mode router: each one's blocks are indexed, past the cap."""
        n = 0
        while self.running:
            n += 1
            tokens = [random.randrange(1, 2**31) for _ in range(64)]
            await self.approx.post("/v1/route", json={"token_ids": tokens, "request_id": f"a{n}", "reserve": True})
            await self.approx.delete(f"/v1/requests/a{n}")
            await asyncio.sleep(0.05)

    async def chat(self) -> None:
        """Multi-turn chats through the cache-blind router: each turn's history is cached on the worker that
        served it (its stored event posted as the engine would publish it), and the next turn is drawn among
        workers that all cost the same."""
        chats = [[random.randrange(1, 2**31) for _ in range(64)] for _ in range(12)]
        n = 0
        while self.running:
            n += 1
            history = random.choice(chats)
            history += [random.randrange(1, 2**31) for _ in range(32)]
            routed = await self.blind.post("/v1/route", json={"model": "blind", "token_ids": history,
                                                              "request_id": f"chat-{n}"})
            assert routed.status_code == 200, routed.text
            stored = _store_event(routed.json()["worker_id"], history, event_id=n)
            await self.blind.post("/v1/events", params={"model": "blind"}, json=[stored])
            await asyncio.sleep(0.02)

    async def publish_junk(self) -> None:
        """Messages no engine would send: the router skips and counts each one."""
        n = 0
        while self.running:
            n += 1
            await self.junk.send_multipart([b"", n.to_bytes(8, "big"), b"\xc1 not msgpack"])
            await asyncio.sleep(0.1)


def shared_or_new() -> list[int]:
    """Half the prompts start with one of three shared prefixes (hits), half are new (spread over workers)."""
    head = random.choice(PREFIXES) if random.random() < 0.5 else [random.randrange(1, 2**31) for _ in range(64)]
    return head + [random.randrange(1, 2**31) for _ in range(32)]


def new() -> list[int]:
    return [random.randrange(1, 2**31) for _ in range(64)]


def repeated() -> list[int]:
    return random.choice(PREFIXES) + PREFIXES[0]


async def stall(process: subprocess.Popen[str], rig: Rig) -> None:
    """Hold a router's whole process (SIGSTOP) for 0.2 s twice a second, as a CPU-starved host or a long pause
    does: its event loop wakes its probes late."""
    while rig.running:
        os.kill(process.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(0.2)
        finally:
            os.kill(process.pid, signal.SIGCONT)
        await asyncio.sleep(0.3)


@contextmanager
def routers(tmp_path: Path) -> Iterator[tuple[str, str, str, subprocess.Popen[str]]]:
    """The router under test, one in approximate mode (its process too, to stall it), and one blind to the cache."""
    quiet = ("--no-restore", "--log-level", "error")  # stderr is a pipe nobody reads while the test runs
    approximate = ("--approximate", "--max-tree-size", str(APPROX_CAP))
    with serving(tmp_path / "router", *quiet) as (_, main), \
            serving(tmp_path / "approx", *quiet, *approximate) as (proc, approx), \
            serving(tmp_path / "blind", *quiet, "--overlap-score-credit", "0") as (_, blind):
        yield str(main.base_url).rstrip("/"), str(approx.base_url).rstrip("/"), str(blind.base_url).rstrip("/"), proc


@asynccontextmanager
async def rig(router_url: str, approx_url: str, blind_url: str) -> AsyncIterator[Rig]:
    configs = [dataclasses.replace(BASE, worker_id=w, faults=f) for w, f in ENGINES.items()]
    ctx = zmq.asyncio.Context()
    junk = ctx.socket(zmq.PUB)
    port = junk.bind_to_random_port("tcp://127.0.0.1")
    try:
        async with AsyncExitStack() as stack:
            fleet = await stack.enter_async_context(Fleet(configs))
            router = await stack.enter_async_context(httpx.AsyncClient(base_url=router_url, timeout=10))
            approx = await stack.enter_async_context(httpx.AsyncClient(base_url=approx_url, timeout=10))
            blind = await stack.enter_async_context(httpx.AsyncClient(base_url=blind_url, timeout=10))
            yield Rig(router, approx, blind, fleet, junk, f"tcp://127.0.0.1:{port}")
    finally:
        junk.close(linger=0)
        ctx.term()


def active(prom: Prom) -> list[dict[str, Any]]:
    return [a for a in prom.alerts() if a["state"] in ("pending", "firing")]


def find(alerts: list[dict[str, Any]], name: str, labels: dict[str, str]) -> dict[str, Any] | None:
    return next((a for a in alerts if a["labels"]["alertname"] == name
                 and all(a["labels"].get(k) == v for k, v in labels.items())), None)


async def test_faults_make_their_alerts_pending_and_every_query_has_data(tmp_path: Path) -> None:
    exporter, dynamo = TierExporter(), DynamoFrontend()
    try:
        with routers(tmp_path) as (router_url, approx_url, blind_url, approx_process):
            async with rig(router_url, approx_url, blind_url) as r:
                targets = {"kvctl": [router_url.removeprefix("http://")],
                           "kvctl-approx": [approx_url.removeprefix("http://")],
                           "kvctl-blind": [blind_url.removeprefix("http://")],
                           "engines": [e.url.removeprefix("http://") for e in r.fleet.engines] + [exporter.instance],
                           "dynamo": [dynamo.instance]}
                with prometheus(targets, tmp_path, rule_files=scaled_rules(tmp_path)) as url:
                    prom = Prom(url)
                    try:
                        await _run(r, prom, url, sum(map(len, targets.values())), approx_process)
                    finally:
                        prom.close()
    finally:
        exporter.close()
        dynamo.close()


async def _run(r: Rig, prom: Prom, url: str, targets: int, approx_process: subprocess.Popen[str]) -> None:
    for worker, model in ((1, "default"), (2, "default"), (CROWDED, "crowded"), (HAUNTED, "haunted")):
        await r.register(worker, model, replay=True)
    for worker in (1, 2):
        assert (await r.approx.post("/v1/workers", json={"worker_id": worker})).status_code == 201
    for worker in BLIND_WORKERS:
        answer = await r.blind.post("/v1/workers", json={"worker_id": worker, "model": "blind"})
        assert answer.status_code == 201, answer.text
    await joined(r.engine(worker) for worker in (1, 2, CROWDED, HAUNTED))  # the router's SUBs, before any load
    tasks = [asyncio.create_task(r.drive("default", shared_or_new, lane)) for lane in "ab"]  # two in flight
    tasks += [asyncio.create_task(r.drive(model, prompt))
              for model, prompt in (("crowded", shared_or_new), ("mismatch", repeated), ("haunted", new))]
    try:
        await asyncio.to_thread(wait_for_scrapes, url, targets, 6, 30.0, ".*")
        # none before any fault, once the start's work is out of the scaled 5 s windows (a start's 100 ms of
        # registrations is 2 % of 5 s: the loop alert's share; it is 0.03 % of the real 5 min)
        await asyncio.to_thread(prom.until, lambda: not active(prom), "no alert before any fault", PENDING_TIMEOUT_S)

        faults: dict[str, float] = {}
        faults["silent"] = time.monotonic()
        await r.register(SILENT, "default")
        faults["drop-every"] = time.monotonic()
        await r.register(DROPPING, "default")  # no replay endpoint: its dropped batches are lost
        faults["block-size"] = time.monotonic()
        await r.register(MISMATCHED, "mismatch")
        faults["restart"] = time.monotonic()
        async with httpx.AsyncClient(base_url=r.engine(RESTARTING).url) as engine:
            assert (await engine.post("/v1/restart")).status_code == 200
        faults["all busy"] = time.monotonic()
        pinned = await r.router.post("/v1/route", json={"model": "crowded", "token_ids": list(range(10**6, 10**6 + 64)),
                                                        "request_id": "pinned", "reserve": True})
        assert pinned.status_code == 200, pinned.text  # its prefill never completes: its tokens stay in flight
        busy = {"model": "crowded", "active_prefill_tokens_threshold": 1}
        assert (await r.router.post("/busy_threshold", json=busy)).status_code == 200
        faults["phantom blocks"] = time.monotonic()
        r.haunted = True
        faults["decode errors"] = time.monotonic()
        tasks.append(asyncio.create_task(r.publish_junk()))
        await r.register(JUNK, "junk", endpoint=r.junk_endpoint)
        faults["index fills"] = time.monotonic()
        tasks.append(asyncio.create_task(r.fill_approx()))
        faults["loop held"] = time.monotonic()
        tasks.append(asyncio.create_task(stall(approx_process, r)))
        faults["cache ignored"] = time.monotonic()
        tasks.append(asyncio.create_task(r.chat()))

        expected = [("silent", "KvctlEngineEventsStopped", {"worker_id": str(SILENT)}),
                    ("drop-every", "KvctlLostBatches", {"worker_id": str(DROPPING)}),
                    ("block-size", "KvctlOverlapAlwaysZero", {"worker_id": str(MISMATCHED), "model": "mismatch"}),
                    ("restart", "KvctlEngineRestarted", {"worker_id": str(RESTARTING)}),
                    ("all busy", "KvctlAllWorkersBusy", {"model": "crowded"}),
                    ("phantom blocks", "KvctlPredictedHitsNotReal", {"worker_id": str(HAUNTED), "model": "haunted"}),
                    ("decode errors", "KvctlDecodeErrors", {"worker_id": str(JUNK)}),
                    ("index fills", "KvctlIndexNearCap", {"job": "kvctl-approx"}),
                    ("loop held", "KvctlLoopLagging", {"job": "kvctl-approx"}),
                    ("cache ignored", "KvctlRoutingMissesCache", {"job": "kvctl-blind", "model": "blind"}),
                    ("cache ignored", "KvctlRouterIgnoresCache", {"job": "kvctl-blind", "model": "blind"})]
        seen: dict[str, float] = {}
        deadline = time.monotonic() + PENDING_TIMEOUT_S
        while len(seen) < len(expected) and time.monotonic() < deadline:
            alerts = await asyncio.to_thread(active, prom)
            for fault, name, labels in expected:
                if name not in seen and find(alerts, name, labels):
                    seen[name] = time.monotonic() - faults[fault]
            await asyncio.sleep(0.25)
        print("\nfault            alert                      fault -> pending")
        for fault, name, _ in expected:
            print(f"{fault:<16} {name:<26} {f'{seen[name]:.1f} s' if name in seen else 'never'}")
        assert sorted(seen) == sorted(name for _, name, _ in expected), f"never pending: {active(prom)}"

        await asyncio.to_thread(_every_query_has_data, prom)
    finally:
        r.running = False
        await asyncio.gather(*tasks, return_exceptions=True)


def _every_query_has_data(prom: Prom) -> None:
    empty = [record for record in recorded() if not prom.query(record)]
    assert not empty, f"recording rules without data: {empty}"
    board = dashboard()
    empty = [(title, expr) for title, expr in panel_queries(board) if not prom.query(expr)]
    assert not empty, f"dashboard queries without data: {empty}"
    unresolved = [name for name, selector, label in variable_lookups(board) if not prom.label_values(selector, label)]
    assert not unresolved, f"dashboard variables with no value: {unresolved}"
