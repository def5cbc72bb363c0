"""`kvctl tiers --metrics`: engines' /metrics scraped twice, the exporter's known rates within 2 %."""

from __future__ import annotations

import json
import math
import os
import pty
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvctl.client.tier_sources import Auth, Scraper
from tests.support import eventually
from tests.tiers.conftest import assert_truth, tiers, tiers_json
from tests.tiers.exporter import GAUGES, HITS, QUERIES, TierExporter
from tests.tiers.prometheus_server import free_port

WINDOW_S = 5 * 60
"""The `--window 5m` the tests ask for: the first figures come long before it."""


def test_every_family_within_two_percent(exporters: list[TierExporter]) -> None:
    doc = tiers_json("--window", "2s", "--wait", *(arg for x in exporters for arg in ("--metrics", x.url)))
    assert doc["basis"] == "window"
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
    doc = tiers_json("--window", "2s", "--wait", "--metrics", exporter.url)
    timer.join()
    for reading in doc["readings"]:
        assert reading["value"] is None or reading["value"] >= 0, reading
        if reading["kind"] == "ratio":
            assert reading["value"] <= 1, reading
    device = next(r for r in doc["readings"] if (r["tier"], r["metric"]) == ("device", "hit_rate")
                  and r["family"].startswith("vllm:"))
    assert device["value"] == pytest.approx(HITS / QUERIES, rel=0.02)  # both counters restarted: the ratio holds
    assert 0 < device["denominator"] < QUERIES * 2  # counted from 0 at the reset, some of the 2 s window


def test_json_answers_at_once_with_the_counters_since_start(exporters: list[TierExporter]) -> None:
    exporter = exporters[0]
    hits_before, started = exporter.counter(HITS), time.monotonic()
    result = tiers("-o", "json", "--window", "5m", "--metrics", exporter.url)
    elapsed, hits_after = time.monotonic() - started, exporter.counter(HITS)
    assert result.exit_code == 0, result.output
    assert elapsed < WINDOW_S / 10, f"{elapsed:.1f} s for the first figures"  # since start, not after the window
    doc = json.loads(result.stdout)
    assert doc["basis"] == "since_start"
    assert doc["instances"] == [{"instance": exporter.instance, "window_s": None}]  # unknown, not Infinity
    device = next(r for r in doc["readings"] if (r["tier"], r["metric"]) == ("device", "hit_rate")
                  and r["family"].startswith("vllm:"))
    assert hits_before <= device["numerator"] <= hits_after  # the counter as it stood, not an increase
    assert device["value"] == pytest.approx(device["numerator"] / device["denominator"])
    host = next(r for r in doc["readings"] if r["family"] == "kvbm_host_cache_hit_rate")
    assert host["value"] == GAUGES["kvbm_host"]
    assert not [r for r in doc["readings"] if r["kind"] == "rate"]  # a rate needs the window's length


def test_table_shows_since_start_then_the_window(exporters: list[TierExporter]) -> None:
    result = tiers("--window", "2s", "--metrics", exporters[0].url)
    assert result.exit_code == 0, result.output
    since, title, window = result.stdout.partition("over the last 2s\n")
    assert since.startswith("since each engine started") and title
    assert "cached_tokens_per_s" not in since and "cached_tokens_per_s" in window
    device = next(line for line in window.splitlines() if line.split()[1:3] == ["device", "hit_rate"]
                  and "vllm:prefix_cache_hits" in line)
    assert f"{HITS / QUERIES:.1%}" in device  # the window's ratio: BASE counted before it is not in it


def test_watched_windows_follow_each_other(exporters: list[TierExporter]) -> None:
    """What --watch shows with --metrics: the since-start figures, then windows each from the last one's end."""
    moments: list[float] = []

    def wait_until(moment: float) -> None:
        moments.append(moment)
        time.sleep(max(0.0, moment - time.monotonic()))

    with Scraper([exporters[0].url], auth=Auth(), timeout=5) as scraper:
        answers = scraper.answers(0.3, since_start=True, wait_until=wait_until)
        first, second, third = (next(answers) for _ in range(3))
    assert math.isinf(first[0].seconds)
    assert second[0].seconds >= 0.3 and third[0].seconds >= 0.3
    assert moments[1] - moments[0] == pytest.approx(second[0].seconds)  # the third began as the second ended


@contextmanager
def on_a_terminal(*args: str) -> Iterator[tuple[subprocess.Popen[str], list[bytes]]]:
    """`kvctl tiers ARGS` with stderr on a pseudo-terminal (drained as it comes) and stdout on a pipe."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "kvctl", "tiers", *args], stdout=subprocess.PIPE, stderr=slave,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    os.close(slave)
    seen: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the process closed its side
                return
            if not chunk:
                return
            seen.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        yield proc, seen
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
        reader.join(timeout=5)
        os.close(master)


def wait_for(text: bytes, seen: list[bytes], timeout: float = 20.0) -> None:
    eventually(lambda: b"".join(seen), f"{text!r} on the terminal", until=lambda out: text in out,
               timeout=timeout, interval=0.05)


def test_a_terminal_gets_the_first_table_at_once_and_a_countdown_and_ctrl_c_keeps_it() -> None:
    exporter = TierExporter()
    try:
        started = time.monotonic()
        with on_a_terminal("--window", "5m", "--metrics", exporter.url) as (proc, seen):
            assert proc.stdout is not None
            assert proc.stdout.readline().startswith("since each engine started")
            assert time.monotonic() - started < WINDOW_S / 10  # a process start and one scrape, not the window
            wait_for(b"measuring the rates over 5m", seen)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=15) == 130
            assert "over the last" not in proc.stdout.read()
            wait_for(b"stopped before the window passed", seen)
    finally:
        exporter.close()


def test_json_on_a_terminal_has_no_countdown() -> None:
    exporter = TierExporter()
    try:
        with on_a_terminal("-o", "json", "--window", "1s", "--wait", "--metrics", exporter.url) as (proc, seen):
            assert proc.stdout is not None
            doc = json.loads(proc.stdout.read())
            assert proc.wait(timeout=15) == 0
    finally:
        exporter.close()
    assert doc["basis"] == "window" and doc["instances"][0]["window_s"] == pytest.approx(1.0, abs=0.2)
    assert b"measuring" not in b"".join(seen)


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
    assert result.stdout.startswith(f"KVCTL TIERS {status} - host hit rate 20.0% on {exporters[0].instance}")


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
    ["--prometheus", "http://127.0.0.1:1", "--metrics", "http://127.0.0.1:1"],
    [],
])
def test_usage_errors(args: list[str]) -> None:
    assert tiers(*args).exit_code == 2


@pytest.mark.parametrize("args", [
    ["--tier", "gpu", "--warn", "0.1", "--metrics", "http://127.0.0.1:1"],
    ["--warn", "0.1", "--crit", "0.5", "--metrics", "http://127.0.0.1:1"],
    ["--warn", "0.1", "--watch", "--metrics", "http://127.0.0.1:1"],
    ["--tier", "host", "--warn", "0.2", "--crit", "0.05"],  # the help's example, run with no source configured
    ["--window=5x", "--crit=0.1", "--metrics", "http://127.0.0.1:1"],
])
def test_a_check_that_cannot_run_is_unknown_not_critical(args: list[str]) -> None:
    """A check's usage error was exit 2: CRITICAL to Nagios, a page for a typo."""
    result = tiers(*args)
    assert result.exit_code == 3 and result.stderr.startswith("error: "), result.output
    result = tiers(*args, "-o", "nagios")
    assert result.exit_code == 3 and result.stdout.startswith("KVCTL TIERS UNKNOWN - error: "), result.output
