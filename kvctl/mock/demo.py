"""`kvctl demo`: a router, mock engines and load on loopback, measured the way serving benchmarks measure.

Three processes, as in production: the router (`kvctl serve`), the mock engines (`kvctl mock`, whose GPU time
follows Dynamo's mocker: prefill priced by uncached tokens, decode by KV in use) and this one, the load
generator. The same shared-prefix workload runs under random placement and under the router, each phase from
cold caches:
- capacity, closed loop: concurrency climbs until TTFT p90 misses the target; the best rate that met it;
- open loop: Poisson arrivals at one offered rate for both policies (a share of random placement's capacity,
  so both run below saturation), where TTFT, end-to-end latency and goodput compare.
What the router costs is measured too: each router call as the load generator saw it, the router's own
decision time from its histogram, and every process's CPU. Everything started here is stopped on exit,
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from kvctl.child_process import kvctl_child
from kvctl.client import AsyncRouterClient
from kvctl.client.engine import EngineClient
from kvctl.client.tier_sources import Auth, Scraper
from kvctl.core.names import DEFAULT_MODEL
from kvctl.core.quantiles import bucket_increase, histogram_quantile
from kvctl.core.tiers import Sample
from kvctl.errors import KvctlError
from kvctl.mock.capacity import CONCURRENCIES, Capacity, capacity
from kvctl.mock.load import (
    GIVE_UP_S,
    Arrival,
    LoadGenerator,
    LoadStats,
    Policy,
    register_engines,
    run_observed,
    shared_prefix,
)
from kvctl.process_cpu import cpu_seconds
from kvctl.runtime import tuned_gc

POLICIES = (Policy.random, Policy.router)
SPEEDUP = 1.0
"""The engines' timing model runs this many times faster than Dynamo's mocker defaults."""
TTFT_SLO_MS = 300.0
"""The TTFT target of goodput and capacity: p90 under it."""
OFFERED_SHARE = 0.7
"""The open loop offers this share of random placement's capacity: both policies below saturation."""


@dataclass(frozen=True, slots=True)
class DemoPlan:
    engines: int = 4
    duration_s: float = 60.0  # four phases of a quarter each: capacity and open loop, per policy
    capacity: int = 1024  # blocks per engine: half the workload's 16 system prompts fit in one
    block_size: int = 16
    max_running: int = 64
    speedup: float = SPEEDUP
    ttft_slo_ms: float = TTFT_SLO_MS
    request_rate: float | None = None  # None: OFFERED_SHARE of random placement's measured capacity
    seed: int = 0
    give_up_s: float = GIVE_UP_S  # the router refusing connections this long ends the demo in an error

    @property
    def phase_s(self) -> float:
        return self.duration_s / 4


Progress = Callable[[str, LoadStats], None]
"""Called with the phase's name (`capacity random`, `open loop router`...) and its statistics so far."""


@contextlib.asynccontextmanager
async def router_process(state_dir: Path, block_size: int) -> AsyncIterator[tuple[str, int]]:
    """`kvctl serve` on a free loopback port; yields its URL and pid."""
    async with kvctl_child(["serve", "--listen", "127.0.0.1:0", "--state-dir", str(state_dir), "--no-restore",
                            "--block-size", str(block_size), "--log-level", "error"], "kvctl serve") as (proc, line):
        if not line.startswith(b"http://"):
            raise RuntimeError(f"kvctl serve announced {line!r}, not its URL")
        yield line.decode().strip(), proc.pid


@contextlib.asynccontextmanager
async def engines_process(plan: DemoPlan) -> AsyncIterator[tuple[list[dict[str, Any]], int]]:
    """`kvctl mock` running the plan's engines in their own process; yields their rows and its pid."""
    async with kvctl_child(["mock", "--engines", str(plan.engines), "--capacity", str(plan.capacity),
                            "--block-size", str(plan.block_size), "--max-running", str(plan.max_running),
                            "--speedup", f"{plan.speedup:g}", "-o", "json"], "kvctl mock") as (proc, line):
        rows = json.loads(line)
        if not isinstance(rows, list) or not rows:
            raise RuntimeError(f"kvctl mock announced {line[:200]!r}, not its engines")
        yield rows, proc.pid


async def run_demo(plan: DemoPlan, announce: Callable[[str, list[dict[str, Any]]], None], progress: Progress,
                   every_s: float = 2.0) -> dict[str, Any]:
    """Run the demo; `announce(router_url, engines)` once everything listens, `progress` every few seconds.
    Raises `Unreachable` when the router dies mid-run (no result then: it would compare a phase with a broken
    one)."""
    workload = shared_prefix(4000, prefix_tokens=2048, suffix_tokens=128, seed=plan.seed)
    with tempfile.TemporaryDirectory(prefix="kvctl-demo-") as state_dir, tuned_gc():  # the workload frozen
        async with router_process(Path(state_dir), plan.block_size) as (url, router_pid), \
                engines_process(plan) as (infos, engines_pid), AsyncRouterClient(url) as router:
            await register_engines(router, infos, DEFAULT_MODEL)
            announce(url, infos)
            engines = {info["worker_id"]: EngineClient(info["url"]) for info in infos}
            costs = _Costs(url, {"load generator": os.getpid(), "engines": engines_pid, "router": router_pid})
            try:
                load = LoadGenerator(engines, router=router, model=DEFAULT_MODEL, seed=plan.seed,
                                     give_up_s=plan.give_up_s)
                result = await _phases(plan, load, workload, costs, progress, every_s)
            finally:
                costs.close()
                await asyncio.gather(*(engine.aclose() for engine in engines.values()))
    return {"router_url": url, "engines": plan.engines, "timing": infos[0].get("timing"), **result}


async def _phases(plan: DemoPlan, load: LoadGenerator, workload: list[Any], costs: _Costs, progress: Progress,
                  every_s: float) -> dict[str, Any]:
    found = {policy: await capacity(load, workload, policy, ttft_slo_ms=plan.ttft_slo_ms,  # from cold caches
                                    step_s=plan.phase_s / len(CONCURRENCIES),
                                    progress=partial(progress, f"capacity {policy}"),
                                    every_s=every_s)
             for policy in POLICIES}
    offered = plan.request_rate or _offered(found[Policy.random])
    open_loop = {}
    for policy in POLICIES:
        await load.clear_caches()  # every phase from cold caches
        before = await costs.start()
        stats = await run_observed(load, workload, policy, partial(progress, f"open loop {policy}"),
                                   every_s, ttft_slo_ms=plan.ttft_slo_ms, request_rate=offered,
                                   arrival=Arrival.poisson, duration_s=plan.phase_s)
        open_loop[policy] = {**stats.report(), **await costs.since(before)}
    return {"ttft_slo_ms": plan.ttft_slo_ms, "offered_per_s": offered,
            "capacity": {p.value: r.report() for p, r in found.items()},
            "open_loop": {p.value: r for p, r in open_loop.items()},
            "hit_rate_gain_points": round(100 * (open_loop[Policy.router]["hit_rate"]
                                                 - open_loop[Policy.random]["hit_rate"]), 1)}


def _offered(random_capacity: Capacity) -> float:
    """OFFERED_SHARE of random placement's capacity; when no step met the TTFT target, of its first step's rate
    (the lightest load it was measured at)."""
    step = random_capacity.best or (random_capacity.steps[0] if random_capacity.steps else None)
    return max(0.5, round(OFFERED_SHARE * (step.requests_per_s if step else 0.0), 1))


@dataclass(frozen=True, slots=True)
class _Mark:
    at: float
    cpu: dict[str, float | None]
    router_metrics: list[Sample] | None  # None: unreadable (the load's own calls say whether the router is gone)


class _Costs:
    """What a phase cost: each process's CPU (cores busy on average) and the router's own route decision time,
    from its `kvctl_route_duration_seconds` histogram."""

    def __init__(self, router_url: str, pids: dict[str, int]) -> None:
        """`pids`: each process to account for, with its own children (the router's decode process), except this
        one, whose children are the others."""
        self.pids = pids
        self._metrics = router_url.rstrip("/") + "/metrics"
        self._scraper = Scraper([self._metrics], auth=Auth(), timeout=5.0)

    async def start(self) -> _Mark:
        return _Mark(time.monotonic(), {name: cpu_seconds(pid, descendants=pid != os.getpid())
                                        for name, pid in self.pids.items()},
                     await self._router_metrics())

    async def _router_metrics(self) -> list[Sample] | None:
        try:
            return await asyncio.to_thread(self._scraper.scrape, self._metrics)
        except KvctlError:
            return None

    def close(self) -> None:
        self._scraper.close()

    async def since(self, before: _Mark) -> dict[str, Any]:
        after = await self.start()
        seconds = after.at - before.at
        buckets = [] if before.router_metrics is None or after.router_metrics is None else bucket_increase(
            "kvctl_route_duration_seconds", before.router_metrics, after.router_metrics, {"model": DEFAULT_MODEL})
        decision = {f"p{round(100 * q)}": _ms(histogram_quantile(q, buckets)) for q in (0.5, 0.99)}
        cores = {name: None if was is None or (now := after.cpu[name]) is None else round((now - was) / seconds, 2)
                 for name, was in before.cpu.items()}
        return {"route_decision_ms": decision, "cpu_cores": cores}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)
