"""`kvctl demo`: a router, mock engines and load on loopback, so a new user sees kvctl's job in one command.

The router runs as its own process (`kvctl serve`, as in production), the engines and the load in
this one. The same shared-prefix workload runs twice from cold caches: first placed at random (the
baseline), then by the router; the difference in achieved prefix hit rate is what KV-aware routing
buys. The router keeps serving during the second phase, so `kvctl top` and friends have something
to show. Everything started here is stopped on exit, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvctl.child_process import python_module
from kvctl.client import AsyncRouterClient
from kvctl.client.engine import EngineClient
from kvctl.mock.engine import EngineConfig
from kvctl.mock.fleet import Fleet, fleet_configs
from kvctl.mock.load import (
    GIVE_UP_S,
    LoadGenerator,
    LoadStats,
    Policy,
    register_engines,
    run_observed,
    shared_prefix,
)


@dataclass(frozen=True, slots=True)
class DemoPlan:
    engines: int = 4
    duration_s: float = 60.0
    baseline_s: float | None = None  # default: half the duration, so both phases' counts compare
    capacity: int = 1024  # blocks per engine: a quarter of the workload's system prompts fits in one
    block_size: int = 16
    concurrency: int = 16
    seed: int = 0
    give_up_s: float = GIVE_UP_S  # the router refusing connections this long ends the demo in an error

    @property
    def baseline(self) -> float:
        return self.baseline_s if self.baseline_s is not None else self.duration_s / 2


@contextlib.asynccontextmanager
async def router_process(state_dir: Path, block_size: int) -> AsyncIterator[str]:
    """`kvctl serve` on a free loopback port; yields its URL, stops it (SIGTERM, then SIGKILL) on exit."""
    proc = await asyncio.create_subprocess_exec(
        *python_module("kvctl"), "serve", "--listen", "127.0.0.1:0", "--state-dir", str(state_dir),
        "--no-restore", "--block-size", str(block_size), "--log-level", "error",
        stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        if not line.startswith(b"http://"):
            raise RuntimeError(f"kvctl serve did not start (exit {await proc.wait()})")
        yield line.decode().strip()
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def run_demo(plan: DemoPlan, announce: Callable[[str, list[dict[str, Any]]], None],
                   progress: Callable[[LoadStats], None], every_s: float = 2.0) -> dict[str, Any]:
    """Run the demo; `announce(router_url, engines)` once everything listens, `progress(stats)` every few
    seconds. Returns both phases' reports and the hit-rate gain in points; raises `Unreachable` when the
    router dies mid-run (no result then: it would compare a phase with a broken one)."""
    base = EngineConfig(worker_id=0, block_size=plan.block_size, capacity=plan.capacity, model_name="default",
                        speedup=1.0, max_running=32, seed=plan.seed)
    workload = shared_prefix(2000, prefix_tokens=2048, suffix_tokens=128, seed=plan.seed)
    with tempfile.TemporaryDirectory(prefix="kvctl-demo-") as state_dir:
        async with router_process(Path(state_dir), plan.block_size) as url, \
                Fleet(fleet_configs(plan.engines, base)) as fleet, AsyncRouterClient(url) as router:
            infos = fleet.infos()
            await register_engines(router, infos, "default")
            announce(url, infos)
            engines = {info["worker_id"]: EngineClient(info["url"]) for info in infos}
            try:
                load = LoadGenerator(engines, router=router, seed=plan.seed, give_up_s=plan.give_up_s)
                baseline = await _phase(load, workload, Policy.random, plan.baseline, plan, progress, every_s)
                await load.clear_caches()
                routed = await _phase(load, workload, Policy.router, plan.duration_s - plan.baseline, plan, progress,
                                      every_s)
            finally:
                await asyncio.gather(*(engine.aclose() for engine in engines.values()))
    return {"router_url": url, "baseline": baseline.report(), "router": routed.report(),
            "hit_rate_gain_points": round(100 * (routed.hit_rate - baseline.hit_rate), 1)}


async def _phase(load: LoadGenerator, workload: list[Any], policy: Policy, seconds: float, plan: DemoPlan,
                 progress: Callable[[LoadStats], None], every_s: float) -> LoadStats:
    return await run_observed(load, workload, policy, progress, every_s, concurrency=plan.concurrency,
                              duration_s=max(0.5, seconds))
