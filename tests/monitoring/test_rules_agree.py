"""The recording rules and `kvctl tiers` on the same numbers: a real Prometheus scrapes exporters of every tier
family (tests/tiers/exporter.py) and evaluates the rules; kvctl's own computation (`core.tiers.report` over the
same server's samples) must give the same figures. Likewise the decision audit's rules and `GET /v1/audit`
(`core.audit.summarise`), over a `kvctl serve` routing a steady mix of decisions."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvctl.client.tier_sources import Auth, prometheus_windows
from kvctl.core.tiers import Reading, report
from tests.monitoring.pack import Prom, scaled_rules
from tests.server.test_api import _store_event
from tests.server.test_serve_process import serving
from tests.tiers.exporter import TierExporter
from tests.tiers.prometheus_server import prometheus, wait_for_scrapes

WINDOW_S = 5.0  # the rules' 5m, scaled
TOLERANCE = 0.02
ENGINE_FAMILY = {"vllm": "vllm:", "sglang": "sglang:", "lmcache": "lmcache:", "kvbm": "kvbm_",
                 "dynamo": "dynamo_component_kv_cache_hit_rate"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prom, list[Reading], list[Reading]]]:
    """The server, and kvctl's readings and totals computed from it."""
    workdir: Path = tmp_path_factory.mktemp("agree")
    exporters = [TierExporter(), TierExporter(remote=True)]
    try:
        with prometheus([e.instance for e in exporters], workdir, rule_files=scaled_rules(workdir)) as url:
            prom = Prom(url)
            wait_for_scrapes(url, len(exporters), scrapes=int(WINDOW_S) + 2)
            prom.until(lambda: prom.query("instance_tier:kv_hit_rate:ratio5m"), "the rules' first evaluation", 10)
            tiers = report(prometheus_windows(url, window_s=WINDOW_S, auth=Auth(), timeout=5.0))
            yield prom, list(tiers.readings), list(tiers.totals)
            prom.close()
    finally:
        for exporter in exporters:
            exporter.close()


def _series(prom: Prom, record: str) -> list[tuple[dict[str, str], float]]:
    result = [(s["metric"], float(s["value"][1])) for s in prom.query(record)]
    assert result, f"{record} has no data"
    return result


def _one(readings: list[Reading], **match: str | None) -> Reading:
    family = match.pop("family")
    found = [r for r in readings if r.family.startswith(family or "")
             and all(getattr(r, key) == value for key, value in match.items())]
    assert len(found) == 1, (family, match, found)
    return found[0]


@pytest.mark.parametrize(("series", "metric"), [("instance_tier:kv_hit_rate:ratio5m", "hit_rate"),
                                                ("instance_tier:kv_cached_tokens:rate5m", "cached_tokens_per_s")])
def test_engine_figures_per_tier_agree_with_kvctl_tiers(served: tuple[Prom, list[Reading], list[Reading]],
                                                        series: str, metric: str) -> None:
    prom, readings, _ = served
    recorded = _series(prom, series)
    for labels, value in recorded:
        reading = _one(readings, instance=labels["instance"], tier=labels["tier"], metric=metric,
                       family=ENGINE_FAMILY[labels["engine"]])
        assert value == pytest.approx(reading.value, rel=TOLERANCE), labels
    # and the other way: every figure kvctl tiers reports has its recorded series
    reported = [r for r in readings if r.metric == metric]
    assert len(recorded) == len(reported), sorted((r.instance, r.tier, r.family) for r in reported)


@pytest.mark.parametrize(("record", "family"), [
    ("instance_model:kvctl_route_predicted_hit_rate:mean_rate5m", "kvctl_route_predicted_hit_rate"),
    ("instance:dynamo_router_kv_hit_rate:mean_rate5m", "dynamo_component_router_kv_hit_rate"),
])
def test_routers_predicted_hit_rates_agree_with_kvctl_tiers(
        served: tuple[Prom, list[Reading], list[Reading]], record: str, family: str) -> None:
    prom, readings, _ = served
    recorded = _series(prom, record)
    assert len(recorded) == 2  # one per exporter
    for labels, value in recorded:
        reading = _one(readings, instance=labels["instance"], metric="predicted_hit_rate", family=family)
        assert value == pytest.approx(reading.value, rel=TOLERANCE), labels


def test_dynamo_cached_share_is_kvctls_total_over_instances(
        served: tuple[Prom, list[Reading], list[Reading]]) -> None:
    """By model over a job's instances: Σ cached / Σ prompt tokens, kvctl tiers' total, not a mean of shares."""
    prom, _, totals = served
    [(labels, value)] = _series(prom, "model:dynamo_frontend_cached_share:ratio_rate5m")
    total = _one(totals, metric="cached_share", family="dynamo_frontend_cached_tokens")
    assert value == pytest.approx(total.value, rel=TOLERANCE), labels


# The audit's mix, one round after another: worker A is busy (a pinned request in prefill, over a threshold of 1
# token) and holds prompt P; worker B holds R. R three times goes to B (optimal, max_overlap), P to another worker
# than A (suboptimal, busy: its 4 blocks avoidable), a prompt nobody holds anywhere (optimal, no_overlap: no cache
# to find). kvctl audit's figures: 3 of 4 optimal, 64 of 256 cached tokens avoidable, no disagreement.
P, R, NEW = list(range(100, 164)), list(range(200, 264)), list(range(300, 364))
ROUND = (R, R, R, P, NEW)


@pytest.fixture(scope="module")
def audited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prom, httpx.Client]]:
    """A Prometheus scraping a router whose own routes follow ROUND, until the module's tests are done."""
    workdir: Path = tmp_path_factory.mktemp("audit")
    with serving(workdir / "router", "--no-restore", "--log-level", "error") as (_, router):
        for worker in (1, 2, 3):
            assert router.post("/v1/workers", json={"worker_id": worker, "model": "m"}).status_code == 201
        pinned = router.post("/v1/route", json={"model": "m", "token_ids": list(range(900, 964)),
                                                "request_id": "pinned", "reserve": True})
        busy = pinned.json()["worker_id"]
        holder = 1 + busy % 3
        for worker, prompt in ((busy, P), (holder, R)):
            router.post("/v1/events", params={"model": "m"}, json=[_store_event(worker, prompt)]).raise_for_status()
        router.post("/busy_threshold", json={"model": "m", "active_prefill_tokens_threshold": 1}).raise_for_status()
        stop = threading.Event()

        def route() -> None:
            with httpx.Client(base_url=router.base_url, timeout=5) as client:
                n = 0
                while not stop.is_set():
                    for prompt in ROUND:
                        n += 1
                        client.post("/v1/route", json={"model": "m", "token_ids": prompt, "request_id": f"d{n}"})
                    stop.wait(0.02)

        load = threading.Thread(target=route, name="audit-load", daemon=True)
        load.start()
        try:
            with prometheus({"kvctl": [router.base_url.netloc.decode()]}, workdir,
                            rule_files=scaled_rules(workdir)) as url:
                prom = Prom(url)
                wait_for_scrapes(url, 1, scrapes=int(WINDOW_S) + 2, job="kvctl")
                prom.until(lambda: prom.query("instance_model:kvctl_audit_optimal_share:ratio_rate5m"),
                           "the audit rules' first evaluation", 10)
                yield prom, router
                prom.close()
        finally:
            stop.set()
            load.join()


def _audit(router: httpx.Client) -> dict[str, Any]:
    body: dict[str, Any] = router.get("/v1/audit", params={"window": WINDOW_S, "model": "m"}).json()
    assert body["decisions"] > 100, body["looked_at"]
    return body


@pytest.mark.parametrize(("record", "figure"), [
    ("instance_model:kvctl_audit_optimal_share:ratio_rate5m", "optimal_share"),
    ("router:kvctl_audit_optimal_share:ratio_rate5m", "optimal_share"),
    ("instance_model:kvctl_audit_avoidable_prefill_share:ratio_rate5m", "avoidable_share"),
])
def test_audit_shares_agree_with_kvctl_audit(audited: tuple[Prom, httpx.Client], record: str, figure: str) -> None:
    """The share over the decisions with cache to find: the no_overlap ones left out, as `summarise` leaves them."""
    prom, router = audited
    [(labels, value)] = _series(prom, record)
    assert labels["model"] == "m" and labels.get("router", "kvctl") == "kvctl", labels
    expected = _audit(router)[figure]
    assert expected == pytest.approx({"optimal_share": 0.75, "avoidable_share": 0.25}[figure], rel=TOLERANCE)
    assert value == pytest.approx(expected, rel=TOLERANCE), labels


def test_disagreement_is_kvctl_audits_agreement_share_turned_over(audited: tuple[Prom, httpx.Client]) -> None:
    prom, router = audited
    [(labels, value)] = _series(prom, "instance_model:kvctl_audit_disagreement:ratio_rate5m")
    assert value == pytest.approx(1 - _audit(router)["agreement_share"], abs=TOLERANCE), labels
