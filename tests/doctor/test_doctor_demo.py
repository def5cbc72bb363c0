"""`kvctl doctor` against the healthy demo fleet (`kvctl demo`'s router process, mock engines and load) while it
routes: OK, with no false warning."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from kvctl.mock.demo import DemoPlan, run_demo
from kvctl.mock.load import LoadStats, Policy
from tests.doctor.rig import doctor


async def test_the_demo_fleet_has_nothing_critical_while_routing(tmp_path: Path) -> None:
    router: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    routing = asyncio.Event()

    def announce(url: str, _: list[dict[str, Any]]) -> None:
        router.set_result(url)

    def progress(phase: str, stats: LoadStats) -> None:
        if stats.policy is Policy.router and stats.completed:
            routing.set()

    demo = asyncio.create_task(run_demo(DemoPlan(duration_s=8.0), announce, progress, every_s=0.2))
    try:
        await asyncio.wait_for(routing.wait(), 60)
        code, report = await asyncio.to_thread(doctor, await router)
    finally:
        result = await demo
    assert result["open_loop"]["router"]["completed"] > 0
    severities = {f["check"]: f["severity"] for f in report["findings"]}
    # Between the baseline and the routed phase the demo clears its engines' caches as vLLM's
    # reset_prefix_cache does (AllBlocksCleared, seq going on): no restart, nothing to warn about.
    assert "restarts" not in severities, report
    assert {check for check, severity in severities.items() if severity != "OK"} == set(), report
    assert code == 0
