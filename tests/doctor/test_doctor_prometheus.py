"""`kvctl doctor --prometheus`: engines' prefix-cache hit rates read from a real Prometheus scraping real mock
engines, against the router's predicted hits."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from kvctl.mock.engine import Faults
from tests.doctor.rig import engines_behind_router, findings
from tests.support import eventually
from tests.tiers.prometheus_server import prometheus, wait_for_scrapes

HITS = "count(increase(vllm:prefix_cache_hits_total[1m]) > 0)"


def wait_for_hits(url: str, engines: int, timeout: float = 20.0) -> None:
    """Until Prometheus has scraped every engine's cache hits (a sample after the load)."""
    with httpx.Client(base_url=url, timeout=2.0) as http:
        eventually(lambda: http.get("/api/v1/query", params={"query": HITS}).json()["data"]["result"],
                   f"Prometheus at {url} to see prefix-cache hits on {engines} engines",
                   until=lambda result: bool(result) and int(float(result[0]["value"][1])) >= engines,
                   timeout=timeout, interval=0.25)


async def test_engines_hitting_their_cache_in_prometheus_while_the_router_predicts_none(tmp_path: Path) -> None:
    (tmp_path / "prometheus").mkdir()
    async with engines_behind_router(tmp_path / "router", faults=Faults(block_size=32)) as rig:  # every engine: 32
        targets = [e.url.removeprefix("http://") for e in rig.fleet.engines]
        with prometheus(targets, tmp_path / "prometheus") as url:
            await asyncio.to_thread(wait_for_scrapes, url, len(targets), 2)
            await rig.load()
            await asyncio.to_thread(wait_for_hits, url, len(targets))
            code, report = await rig.doctor("--prometheus", url, "--window", "1m")
    [finding] = findings(report, "hit_rate")
    assert code == 2 and finding["severity"] == "CRITICAL"
    assert finding["evidence"]["router_predicted"] == 0 and finding["evidence"]["engines_mean"] >= 0.3
    assert set(finding["evidence"]["engines"]) == set(targets)
