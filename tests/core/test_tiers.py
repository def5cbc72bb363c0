"""The tier math of `kvctl tiers`: counter resets, ratios in [0, 1], shares summing to 1, names matched by pattern."""

from __future__ import annotations

import json
import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvctl.client.tier_sources import parse_metrics
from kvctl.core.events.types import Tier
from kvctl.core.tiers import (
    FAMILIES,
    Basis,
    Sample,
    Status,
    Window,
    check,
    counter_increase,
    family_of,
    increases,
    parse_duration,
    report,
)
from kvctl.mock.cache import Allocation, Transfers
from kvctl.mock.metrics import EngineMetrics

counts = st.floats(min_value=0, max_value=1e12, allow_nan=False)


@given(counts, counts)
def test_increase_is_never_negative_and_a_reset_counts_from_zero(before: float, after: float) -> None:
    got = counter_increase(before, after)
    assert got >= 0
    assert got == (after - before if after >= before else after)


@given(st.lists(st.tuples(counts, counts), min_size=1, max_size=4), counts, counts)
def test_ratios_stay_in_unit_interval_through_resets(sources: list[tuple[float, float]], q0: float, q1: float) -> None:
    """Any two scrapes (resets anywhere, even of one counter and not the other) give ratios in [0, 1] and shares
    that sum to 1."""
    names = ["device", "host", "disk", "p2p"]
    before = [Sample("vllm:prefix_cache_queries_total", {}, q0), Sample("vllm:prefix_cache_hits_total", {}, 0.0)]
    after = [Sample("vllm:prefix_cache_queries_total", {}, q1), Sample("vllm:prefix_cache_hits_total", {}, q1)]
    for name, (b, a) in zip(names, sources, strict=False):
        labels = {"source": name}
        before.append(Sample("vllm:prompt_tokens_cached_by_source_total", labels, b))
        after.append(Sample("vllm:prompt_tokens_cached_by_source_total", labels, a))
    got = report([Window("e", 1.0, increases(before, after))])
    for reading in got.readings + got.totals:
        if reading.kind == "ratio" and reading.value is not None:
            assert 0.0 <= reading.value <= 1.0
        if reading.value is not None:
            assert reading.value >= 0
    shares = [r.value for r in got.readings if r.metric == "share"]
    if all(v is not None for v in shares):
        assert sum(shares) == pytest.approx(1.0)


@pytest.mark.parametrize(("name", "labels", "doc", "variant"), [
    ("kvbm_offload_blocks_d2h", {}, "kvbm_offload_blocks_{d2h,h2d,d2d,d2o}", "d2h"),
    ("kvbm_offload_blocks_d2h_total", {}, "kvbm_offload_blocks_{d2h,h2d,d2d,d2o}", "d2h"),  # the parser's renaming
    ("kvbm_onboard_blocks_r2d", {}, "kvbm_onboard_blocks_{h2d,d2d,o2d}", "o2d"),
    ("kvbm_remote_cache_hit_rate", {}, "kvbm_{host,disk,object}_cache_hit_rate", "object"),
    ("kvbm_remote_write_failures", {}, "kvbm_object_{read,write}_failures", "write"),
    ("vllm:gpu_cache_usage_perc", {}, "vllm:kv_cache_usage_perc", ""),
    ("sglang:cached_tokens_total", {"cache_source": "storage"}, "sglang:cached_tokens_total", "disk"),
    ("vllm:prompt_tokens_cached_by_source", {"source": "external_unspecified"}, "vllm:prompt_tokens_cached_by_source",
     "external"),
    ("kvctl_route_predicted_hit_rate_count", {}, "kvctl_route_predicted_hit_rate", "count"),
])
def test_names_are_matched_by_pattern(name: str, labels: dict[str, str], doc: str, variant: str) -> None:
    found = family_of(name, labels)
    assert found is not None and (found[0].doc, found[1]) == (doc, variant)


@pytest.mark.parametrize("name", ["kvbm_offload_blocks_d2h_bucket", "kvctl_route_predicted_hit_rate_bucket",
                                  "vllm:prefix_cache_hits_created", "vllm:kv_cache_usage_perc_total"])
def test_other_names_are_not_read(name: str) -> None:
    assert family_of(name) is None


def test_absent_families_are_reported_and_checks_say_unknown() -> None:
    got = report([Window("e", 10.0, (Sample("kvbm_host_cache_hit_rate", {}, 0.4),))])
    assert got.found == ("kvbm_{host,disk,object}_cache_hit_rate",)
    assert "vllm:prefix_cache_hits" in got.missing and "dynamo_frontend_cached_tokens" in got.missing
    assert len(got.missing) == len(FAMILIES) - 1  # every family but the one found
    assert check(got, "disk", warn=0.5, crit=0.1).status is Status.UNKNOWN
    assert check(got, "host", warn=0.5, crit=0.1).status is Status.WARNING


def test_worst_instance_decides_and_totals_are_sums_of_parts() -> None:
    def window(name: str, hits: float, queries: float) -> Window:
        return Window(name, 10.0, (Sample("vllm:prefix_cache_hits_total", {}, hits),
                                   Sample("vllm:prefix_cache_queries_total", {}, queries)))

    got = report([window("a", 90, 100), window("b", 10, 900)])
    total = next(r for r in got.totals if r.metric == "hit_rate")
    assert total.value == pytest.approx(100 / 1000)  # Σ hits / Σ queries, not the mean of 0.9 and 0.011
    result = check(got, "device", warn=0.5, crit=0.05)
    assert (result.status, result.worst and result.worst.instance) == (Status.CRITICAL, "b")
    assert report([window("a", 1, 1), window("b", 1, 1)], instance=re.compile("^b")).instances == (("b", 10.0),)


def test_counters_since_start_give_ratios_and_counts_but_no_rates() -> None:
    """One scrape: a window of unknown length. Its ratios hold; a rate over it would be a made-up number."""
    samples = (Sample("vllm:prefix_cache_queries_total", {}, 400.0), Sample("vllm:prefix_cache_hits_total", {}, 100.0),
               Sample("vllm:prompt_tokens_cached_by_source_total", {"source": "host"}, 60.0),
               Sample("kvbm_matched_tokens", {}, 70.0), Sample("kvbm_offload_blocks_d2h", {}, 9.0),
               Sample("kvbm_object_read_failures", {}, 3.0))
    since_start = report([Window("a", math.inf, samples)])
    assert since_start.basis is Basis.since_start
    got = {(r.tier, r.metric): r.value for r in since_start.readings}
    assert got == {("device", "hit_rate"): 0.25, ("host", "hit_rate"): 0.15, ("host", "share"): 1.0,
                   ("object", "read_failures"): 3.0}
    doc = json.loads(json.dumps(since_start.to_dict(), allow_nan=False))  # strict JSON: no Infinity
    assert doc["basis"] == "since_start" and doc["instances"] == [{"instance": "a", "window_s": None}]
    windowed = report([Window("a", 10.0, samples)])
    assert windowed.basis is Basis.window and windowed.to_dict()["instances"][0]["window_s"] == 10.0
    assert {r.metric for r in windowed.readings if r.kind == "rate"} == {
        "cached_tokens_per_s", "matched_tokens_per_s", "offload_blocks_per_s"}


def test_the_mock_engines_kvbm_hit_rates() -> None:
    """`kvctl mock --tiers` engines: their host and disk hit rates come through the parser unchanged."""
    metrics = EngineMetrics(model_name="m", block_size=4, usage=lambda: 0.5, running=lambda: 1, waiting=lambda: 0,
                            transfers=Transfers(offload_d2h=3), lower_tiers=(Tier.host_pinned, Tier.disk))
    before = parse_metrics(metrics.render().decode())
    metrics.record(Allocation(generation=0, blocks=(), prompt_blocks=10,
                              hits={Tier.device: 2, Tier.host_pinned: 3, Tier.disk: 1}, events=()), prompt_tokens=40)
    got = report([Window("mock", 2.0, increases(before, parse_metrics(metrics.render().decode())))])
    rates = {(r.tier, r.metric, r.family): r.value for r in got.readings}
    assert rates["host", "hit_rate", "kvbm_host_cache_hit_rate"] == pytest.approx(0.3)
    assert rates["disk", "hit_rate", "kvbm_disk_cache_hit_rate"] == pytest.approx(0.1)
    assert rates["device", "hit_rate", "vllm:prefix_cache_hits / vllm:prefix_cache_queries"] == pytest.approx(0.2)
    assert rates["host", "share", "vllm:prompt_tokens_cached_by_source"] == pytest.approx(0.5)


@pytest.mark.parametrize(("text", "seconds"), [("5m", 300), ("90s", 90), ("1h30m", 5400), ("250ms", 0.25),
                                               ("7", 7)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "5x", "m5", "0s", "-5s", "1.5m"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)
