"""The recording rules and `kvctl tiers` on the same numbers: a real Prometheus scrapes exporters of every tier
family (tests/tiers/exporter.py) and evaluates the rules; kvctl's own computation (`core.tiers.report` over the
same server's samples) must give the same figures."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.client.tier_sources import Auth, prometheus_windows
from kvctl.core.tiers import Reading, report
from tests.monitoring.pack import Prom, scaled_rules
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
