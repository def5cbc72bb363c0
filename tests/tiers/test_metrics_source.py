"""`kvctl tiers --metrics`: engines' /metrics scraped twice, the exporter's known rates within 2 %."""

from __future__ import annotations

import json
import threading

import pytest

from tests.tiers.conftest import assert_truth, tiers, tiers_json
from tests.tiers.exporter import HITS, QUERIES, TierExporter
from tests.tiers.prometheus_server import free_port


def test_every_family_within_two_percent(exporters: list[TierExporter]) -> None:
    doc = tiers_json("--window", "2s", *(arg for x in exporters for arg in ("--metrics", x.url)))
    assert [i["instance"] for i in doc["instances"]] == sorted(x.instance for x in exporters)
    for entry in doc["instances"]:
        assert entry["window_s"] == pytest.approx(2.0, abs=0.1)
        assert_truth(doc, entry["instance"], entry["window_s"])
    total = next(r for r in doc["totals"] if (r["tier"], r["metric"]) == ("device", "hit_rate")
                 and r["family"].startswith("vllm:"))
    assert total["value"] == pytest.approx(HITS / QUERIES, rel=0.02)


def test_counter_reset_mid_window_is_no_negative_or_impossible_rate(exporters: list[TierExporter]) -> None:
    exporter = exporters[0]
    timer = threading.Timer(1.0, exporter.reset)
    timer.start()
    doc = tiers_json("--window", "2s", "--metrics", exporter.url)
    timer.join()
    for reading in doc["readings"]:
        assert reading["value"] is None or reading["value"] >= 0, reading
        if reading["kind"] == "ratio":
            assert reading["value"] <= 1, reading
    device = next(r for r in doc["readings"] if (r["tier"], r["metric"]) == ("device", "hit_rate")
                  and r["family"].startswith("vllm:"))
    assert device["value"] == pytest.approx(HITS / QUERIES, rel=0.02)  # both counters restarted: the ratio holds
    assert 0 < device["denominator"] < QUERIES * 2  # counted from 0 at the reset, some of the 2 s window


@pytest.mark.parametrize("auth", [("ops", "s3cret"), "t0ken"], ids=["basic", "bearer"])
def test_auth(auth: tuple[str, str] | str) -> None:
    exporter = TierExporter(auth=auth)
    flags = ["--auth-user", auth[0], "--auth-password", auth[1]] if isinstance(auth, tuple) else \
        ["--bearer-token", auth]
    try:
        refused = tiers("--window", "1s", "--metrics", exporter.url)
        assert refused.exit_code == 1
        assert "HTTP 401" in refused.stderr
        assert tiers("--window", "1s", "--metrics", exporter.url, *flags).exit_code == 0
    finally:
        exporter.close()


def test_table_names_families_and_lists_the_missing() -> None:
    exporter = TierExporter(engines=False)  # KVBM only
    try:
        result = tiers("--window", "1s", "--metrics", exporter.url)
    finally:
        exporter.close()
    assert result.exit_code == 0, result.output
    host = next(line for line in result.stdout.splitlines() if "kvbm_host_cache_hit_rate" in line)
    assert "35.0%" in host and "███████" in host
    assert "kvbm_offload_blocks_d2d+kvbm_offload_blocks_h2d" in result.stdout
    [missing] = [line for line in result.stderr.splitlines() if line.startswith("not found")]
    assert missing.startswith(f"not found at {exporter.url}: ") and len(missing) < 160, missing
    assert "(vllm, sglang, lmcache, kvctl, dynamo)" in missing  # whose, not every family's name


@pytest.mark.parametrize(("warn", "crit", "status", "code"), [
    ("0.15", "0.1", "OK", 0), ("0.5", "0.1", "WARNING", 1), ("0.5", "0.4", "CRITICAL", 2)])
def test_check_exit_codes(exporters: list[TierExporter], warn: str, crit: str, status: str, code: int) -> None:
    # host: vLLM's cached-by-source over queries (100/500 = 0.2) wins over KVBM's gauge (0.35): it is over the window
    result = tiers("--window", "1s", "--metrics", exporters[0].url, "--tier", "host", "--warn", warn, "--crit", crit)
    assert result.exit_code == code, result.output
    assert result.stdout.startswith(f"TIERS {status} - host hit rate 20.0% on {exporters[0].instance}")


def test_check_unknown_without_data_and_json_verdict() -> None:
    exporter = TierExporter(kvbm=False)  # no object tier anywhere
    try:
        result = tiers("-o", "json", "--window", "1s", "--metrics", exporter.url, "--tier", "object", "--warn", "0.5")
    finally:
        exporter.close()
    assert result.exit_code == 3
    assert json.loads(result.stdout)["check"]["status"] == "UNKNOWN"


def test_unreachable_endpoint_exits_3_naming_it() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = tiers("--window", "1s", "--metrics", url)
    assert result.exit_code == 3
    assert f"{url}/metrics" in result.stderr


@pytest.mark.parametrize("args", [
    ["--window", "5x", "--metrics", "http://127.0.0.1:1"],
    ["--instance", "(", "--metrics", "http://127.0.0.1:1"],
    ["--tier", "gpu", "--warn", "0.1", "--metrics", "http://127.0.0.1:1"],
    ["--warn", "0.1", "--crit", "0.5", "--metrics", "http://127.0.0.1:1"],
    ["--warn", "0.1", "--watch", "--metrics", "http://127.0.0.1:1"],
    ["--prometheus", "http://127.0.0.1:1", "--metrics", "http://127.0.0.1:1"],
    [],
])
def test_usage_errors(args: list[str]) -> None:
    assert tiers(*args).exit_code == 2
