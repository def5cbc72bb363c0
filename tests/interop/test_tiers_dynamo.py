"""`kvctl tiers` and `doctor`'s hit-rate check on a live Dynamo 1.6.1 fleet: the frontend's router prediction
(`dynamo_component_router_kv_hit_rate`, a histogram), its engines' cached-token share, the mocker's KV usage,
and the note that the fleet exports no tier counters, read straight from `/metrics` and through Prometheus; and the
monitoring pack's Dynamo queries answered by that live fleet.

This module has a fleet of its own (tests/tiers/dynamo_fleet.py: one mocker serving `/metrics` on Dynamo's system
status server, and Dynamo's frontend): the package's shared fleet runs its mockers without a status server, so
they have no `/metrics` to read. The truth is read here independently: the load's own HTTP usage (cached and
prompt tokens the frontend answered with) and the endpoints' text scraped by this module, parsed by a regex.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.commands.live_router import loaded_router
from tests.doctor.rig import doctor, findings
from tests.interop.fleet import LoadResult, shared_prefix_load, wait_until
from tests.monitoring.pack import Prom, dashboard, panel_queries, recorded, scaled_rules
from tests.tiers.conftest import tiers_json
from tests.tiers.dynamo_fleet import StatusFleet, start_status_fleet
from tests.tiers.prometheus_server import prometheus, wait_for_scrapes

PREDICTED = "dynamo_component_router_kv_hit_rate (mean)"
CACHED = "dynamo_frontend_cached_tokens / dynamo_frontend_input_sequence_tokens (sums)"


@pytest.fixture(scope="module")
def status_fleet(dynamo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StatusFleet]:
    started = start_status_fleet(tmp_path_factory.mktemp("interop-tiers"), dynamo, mockers=1)
    yield started
    started.stop()


def urls(fleet: StatusFleet) -> tuple[str, str]:
    return f"{fleet.frontend_url}/metrics", fleet.metrics_url(fleet.mockers[0])


def instance(url: str) -> str:
    return url.removeprefix("http://").split("/")[0]


def value(url: str, name: str) -> float:
    """The sum of every series of `name` in the endpoint's exposition now (0 when it has none yet)."""
    text = httpx.get(url, timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def predicted_now(frontend: str) -> tuple[float, float]:
    return (value(frontend, "dynamo_component_router_kv_hit_rate_sum"),
            value(frontend, "dynamo_component_router_kv_hit_rate_count"))


def only(readings: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    hits = [r for r in readings if all(r[k] == v for k, v in match.items())]
    assert len(hits) == 1, (match, readings)
    return hits[0]


def test_tiers_over_a_window_from_the_live_frontend_and_mocker(status_fleet: StatusFleet) -> None:
    frontend, mocker = urls(status_fleet)
    sum_before, count_before = predicted_now(frontend)
    loads: list[tuple[LoadResult, float]] = []

    def load_after_the_first_scrape() -> None:
        time.sleep(1.5)
        loads.append((shared_prefix_load(status_fleet.frontend_url, requests=16, seed=11), time.monotonic()))

    loader = threading.Thread(target=load_after_the_first_scrape)
    loader.start()
    doc = tiers_json("--window", "12s", "--wait", "--metrics", frontend, "--metrics", mocker)
    returned = time.monotonic()
    loader.join()
    (load, loaded), = loads
    assert load.failed == [] and loaded < returned - 2, "the load must fall inside the window"
    sum_after, count_after = predicted_now(frontend)

    predicted = only(doc["readings"], instance=instance(frontend), metric="predicted_hit_rate")
    assert predicted["family"] == PREDICTED and predicted["denominator"] == count_after - count_before == 16
    assert predicted["value"] == pytest.approx((sum_after - sum_before) / (count_after - count_before))
    cached = only(doc["readings"], instance=instance(frontend), metric="cached_share")
    assert cached["family"] == CACHED
    assert (cached["numerator"], cached["denominator"]) == (load.cached_tokens, load.prompt_tokens)
    usage = only(doc["readings"], instance=instance(mocker), metric="usage")
    assert (usage["tier"], usage["family"]) == ("device", "vllm:kv_cache_usage_perc")
    assert usage["value"] == value(mocker, "vllm:kv_cache_usage_perc")  # quiet since: the gauge as it is now

    both = sorted([instance(frontend), instance(mocker)])
    assert doc["no_tier_counters"] == {
        "instances": both,
        "note": f"no tier counters exported by {', '.join(both)}: this fleet reports no host/disk/object tier hits"}
    assert not [r for r in doc["readings"] if r["tier"] not in (None, "device")]


def test_tiers_through_prometheus_scraping_the_live_fleet(status_fleet: StatusFleet, tmp_path: Path) -> None:
    frontend, mocker = urls(status_fleet)
    # Dynamo's per-model histograms appear with the first request, and increase() counts nothing of a series'
    # first sample: a warm-up makes them exist before Prometheus' first scrape.
    assert shared_prefix_load(status_fleet.frontend_url, requests=2, seed=21).failed == []
    targets = [instance(frontend), instance(mocker)]
    with prometheus(targets, tmp_path) as url:
        wait_for_scrapes(url, len(targets), 2)
        sum_before, count_before = predicted_now(frontend)
        load = shared_prefix_load(status_fleet.frontend_url, requests=16, seed=22)
        assert load.failed == []
        sum_after, count_after = predicted_now(frontend)

        def scraped_after_the_load() -> bool:
            name = "dynamo_frontend_cached_tokens_count"
            answer = httpx.get(f"{url}/api/v1/query", params={"query": name}, timeout=5).json()["data"]["result"]
            return bool(answer) and float(answer[0]["value"][1]) == value(frontend, name)

        wait_until(scraped_after_the_load, "Prometheus scraping the frontend after the load", timeout=20)
        doc = tiers_json("--prometheus", url, "--window", "1m")

    # increase() extrapolates to the window's edges, and stops a counter's extrapolation at 0, which it reaches
    # at a different point for a _sum than for its _count: the ratios are the truth within 2 %, not exactly.
    predicted = only(doc["readings"], instance=instance(frontend), metric="predicted_hit_rate")
    assert predicted["family"] == PREDICTED
    assert predicted["value"] == pytest.approx((sum_after - sum_before) / (count_after - count_before), rel=0.02)
    cached = only(doc["readings"], instance=instance(frontend), metric="cached_share")
    assert cached["value"] == pytest.approx(load.cached_tokens / load.prompt_tokens, rel=0.02)
    usage = only(doc["readings"], instance=instance(mocker), metric="usage")
    assert usage["family"] == "vllm:kv_cache_usage_perc" and 0 <= usage["value"] <= 1
    assert doc["no_tier_counters"]["instances"] == sorted(targets)


def test_doctor_compares_the_mocker_s_reported_hits_with_dynamo_s_prediction(status_fleet: StatusFleet,
                                                                              tmp_path: Path) -> None:
    frontend, mocker = urls(status_fleet)
    assert shared_prefix_load(status_fleet.frontend_url, requests=8, seed=31).failed == []
    with loaded_router(tmp_path) as client:  # a kvctl router that has routed nothing: the prediction is Dynamo's
        _, report = doctor(str(client.base_url).rstrip("/"), "--metrics", frontend, "--metrics", mocker)
    total, count = predicted_now(frontend)
    cached = value(frontend, "dynamo_frontend_cached_tokens_sum") / \
        value(frontend, "dynamo_frontend_input_sequence_tokens_sum")
    [finding] = findings(report, "hit_rate")
    evidence = finding["evidence"]
    assert evidence["engines"] == {instance(frontend): round(cached, 3)}  # since the frontend started
    assert evidence["router_predicted"] == round(total / count, 3)
    assert evidence["router_predicted_by"] == PREDICTED
    assert finding["severity"] == "OK"  # the mocker hits what Dynamo's router predicts: they agree on blocks


def test_the_monitoring_pack_s_dynamo_queries_have_data_from_the_live_fleet(status_fleet: StatusFleet,
                                                                           tmp_path: Path) -> None:
    """The pack's recording rules and dashboard queries over Dynamo's families (contrib/monitoring) return data from
    a live Dynamo 1.6.1 frontend and mocker under load, not only from the captured text tests/monitoring serves."""
    frontend, mocker = urls(status_fleet)
    assert shared_prefix_load(status_fleet.frontend_url, requests=2, seed=41).failed == []  # the series exist
    targets = {"dynamo": [instance(frontend)], "engines": [instance(mocker)]}
    stop = threading.Event()

    def keep_loading() -> None:  # the rules' rates need traffic in their (scaled) 5 s windows
        for seed in itertools.count(42):
            if stop.is_set():
                return
            shared_prefix_load(status_fleet.frontend_url, requests=4, seed=seed)

    with prometheus(targets, tmp_path, rule_files=scaled_rules(tmp_path)) as url:
        prom = Prom(url)
        loader = threading.Thread(target=keep_loading)
        loader.start()
        try:
            wait_for_scrapes(url, len(targets), 6, job=".*")
            records = [record for record in recorded() if "dynamo" in record]
            queries = [(title, expr) for title, expr in panel_queries(dashboard()) if "dynamo_" in expr]
            assert records and queries
            prom.until(lambda: all(prom.query(record) for record in records), "every Dynamo recording rule",
                       timeout=30)
            empty = [(title, expr) for title, expr in queries if not prom.query(expr)]
            assert not empty, f"dashboard queries without data from the live fleet: {empty}"
        finally:
            stop.set()
            loader.join()
            prom.close()
