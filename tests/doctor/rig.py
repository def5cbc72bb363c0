"""A real `kvctl serve` process fed by real mock engines (with fault knobs), and `kvctl doctor` run against it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from kvctl import http_api as api
from kvctl.cli import app
from kvctl.client import AsyncRouterClient, calls
from kvctl.client.engine import EngineClient
from kvctl.mock.engine import EngineConfig, Faults
from kvctl.mock.fleet import Fleet, fleet_configs
from kvctl.mock.load import LoadGenerator, Policy, register_engines, shared_prefix
from tests.server.test_serve_process import serving
from tests.support import eventually_async, joined

BASE = EngineConfig(worker_id=1, model_name="default", block_size=16, capacity=256,
                    speedup=100.0)


def doctor(url: str, *args: str) -> tuple[int, dict[str, Any]]:
    """`kvctl --server URL doctor -o json ARGS`: its exit code and report."""
    result = CliRunner().invoke(app, ["--server", url, "doctor", "-o", "json", *args])
    return result.exit_code, json.loads(result.stdout)


def findings(report: dict[str, Any], check: str) -> list[dict[str, Any]]:
    return [f for f in report["findings"] if f["check"] == check]


@dataclass
class Rig:
    url: str
    router: AsyncRouterClient
    fleet: Fleet

    async def load(self, requests: int = 24, *, concurrency: int = 4) -> None:
        """A shared-prefix workload routed by the router: every engine stores and evicts blocks."""
        engines = {e.config.worker_id: EngineClient(e.url) for e in self.fleet.engines}
        try:
            workload = shared_prefix(requests, prefixes=3, prefix_tokens=64, suffix_tokens=32, output_tokens=4)
            await LoadGenerator(engines, router=self.router).run(workload, Policy.router, concurrency=concurrency)
        finally:
            await asyncio.gather(*(e.aclose() for e in engines.values()))

    async def doctor(self, *args: str) -> tuple[int, dict[str, Any]]:
        return await asyncio.to_thread(doctor, self.url, *args)

    async def status(self) -> api.Status:
        return await self.router.send(calls.status())

    async def until(self, predicate: Callable[[list[api.Worker]], bool], what: str,
                    timeout: float = 10.0) -> list[api.Worker]:
        """Poll the router's workers until `predicate` holds on them."""
        async def workers() -> list[api.Worker]:
            return (await self.router.send(calls.workers())).workers

        return await eventually_async(workers, what, until=predicate, timeout=timeout)


@asynccontextmanager
async def engines_behind_router(state_dir: Path, engines: int = 3, *, faults: Faults | None = None,
                                fault_engines: list[int] | None = None, replay: bool = True,
                                base: EngineConfig = BASE) -> AsyncIterator[Rig]:
    """A router process and `engines` mock engines it subscribes to (faults on `fault_engines`, or on all);
    without `replay` the router is not told the engines' replay endpoints."""
    with serving(state_dir, "--no-restore") as (_, client):
        url = str(client.base_url).rstrip("/")
        async with Fleet(fleet_configs(engines, base, faults=faults, fault_engines=fault_engines)) as fleet, \
                AsyncRouterClient(url) as router:
            rows = fleet.infos() if replay else [{**row, "replay_endpoint": None} for row in fleet.infos()]
            await register_engines(router, rows, "default")
            await joined(fleet.engines)  # the router's SUBs have joined: nothing the engines publish is lost
            yield Rig(url, router, fleet)
