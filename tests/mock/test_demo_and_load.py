"""`kvctl demo` headless and `kvctl mock load` against a real router and real mock engines."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from kvctl.mock.load import mooncake_trace, shared_prefix
from tests.fixtures_path import FIXTURES
from tests.support.served import on_both_route_paths

TRACE = FIXTURES / "traces" / "conversation_trace.jsonl"


def _kvctl(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvctl", *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1", **env})


def _listening(url: str) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.mark.slow
@on_both_route_paths
def test_demo_headless_measures_both_policies_at_equal_load_and_leaves_nothing_running() -> None:
    result = _kvctl("demo", "--duration", "16", "--ttft-slo", "1000", "-o", "json", timeout=120)  # 4 s a phase
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ttft_slo_ms"] == 1000  # the target both goodput and capacity are judged by
    for step in report["capacity"]["random"]["steps"] + report["capacity"]["router"]["steps"]:
        assert step["met_slo"] == (step["ttft_p90_ms"] is not None and step["ttft_p90_ms"] <= 1000), step
    random_, routed = report["open_loop"]["random"], report["open_loop"]["router"]
    assert (random_["policy"], routed["policy"]) == ("random", "router")
    assert random_["offered_per_s"] == routed["offered_per_s"] == report["offered_per_s"] > 0  # equal offered load
    assert random_["errors"] == {} and routed["errors"] == {}
    assert random_["completed"] > 20 and routed["completed"] > 20
    # the router must beat random placement clearly; a 4-s phase serves a few dozen requests, so its gain spreads
    # widely around the ~28 points of the 60-s runs (15 to 20 in this test's runs of 2026-11-26): 10 is "clearly"
    assert report["hit_rate_gain_points"] >= 10, report
    for policy in ("random", "router"):  # each policy's capacity: the closed-loop steps it climbed
        assert report["capacity"][policy]["steps"], report["capacity"]
    # The router's cost, measured: each of its three calls once per request, its own decision time, every
    # process's CPU. The baseline makes no router call.
    calls = routed["router_calls_ms"]
    assert set(calls) == {"route", "prefill_complete", "free"} and calls["route"]["count"] >= routed["completed"]
    assert random_["router_calls_ms"] == {}
    assert routed["route_decision_ms"]["p50"] is not None
    assert set(routed["cpu_cores"]) == {"load generator", "engines", "router"}
    assert "Dynamo mocker" in report["timing"]
    assert "hit rate" in result.stderr  # the periodic summaries went to stderr, stdout stayed data
    assert not _listening(report["router_url"])  # the router process is gone...
    assert not any(_listening(url) for url in re.findall(r"engine \d+ +(http://\S+)", result.stderr))  # ...engines too


@contextmanager
def _process(*args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    with subprocess.Popen([sys.executable, "-m", "kvctl", *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          stdin=subprocess.DEVNULL, text=True) as proc:
        try:
            assert proc.stdout is not None
            yield proc, proc.stdout.readline()
        finally:
            proc.terminate()
            proc.wait(10)


@on_both_route_paths
def test_mock_load_runs_the_router_lifecycle_and_a_baseline(tmp_path: Path) -> None:
    """Against a router with an admin token: registering the engines needs it, routing does not."""
    with _process("serve", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path), "--no-restore",
                  "--admin-token", "t0ken") as (_, url), \
            _process("mock", "--engines", "2", "--capacity", "256", "--speedup", "10", "-o", "json") as (_, rows):
        engines = tmp_path / "engines.json"
        engines.write_text(rows)
        load = ("mock", "load", "--server", url.strip(), "--engines-file", str(engines), "--requests", "40",
                "--concurrency", "4", "--baseline", "round-robin", "-o", "json")
        refused = _kvctl(*load)
        assert refused.returncode != 0 and "KVCTL_TOKEN" in refused.stderr, refused.stderr
        result = _kvctl(*load, KVCTL_TOKEN="t0ken")
        assert result.returncode == 0, result.stderr
        assert f"registered 2 engines with {url.strip()} (model 'mock'): 1:0, 2:0" in result.stderr
        router, baseline = json.loads(result.stdout)
        assert (router["policy"], baseline["policy"]) == ("router", "round-robin")
        assert router["completed"] == baseline["completed"] == 40
        assert router["errors"] == {} and 0 < router["hit_rate"] < 1
        # the engines were registered from the file, and every request the router reserved was freed
        workers = httpx.get(f"{url.strip()}/v1/workers").json()["workers"]
        assert sorted(w["worker_id"] for w in workers) == [1, 2]
        assert all(w["active_requests"] == 0 and w["blocks"] > 0 for w in workers)


@on_both_route_paths
def test_mock_load_open_loop_reports_latencies_goodput_and_router_calls(tmp_path: Path) -> None:
    """--request-rate offers the same arrivals to each policy, --concurrency caps them; --ttft-slo adds goodput
    (all within a loose SLO); each router call is timed once per request."""
    with _process("serve", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path), "--no-restore") as (_, url), \
            _process("mock", "--engines", "2", "--capacity", "256", "-o", "json") as (_, rows):
        engines = tmp_path / "engines.json"
        engines.write_text(rows)
        result = _kvctl("mock", "load", "--server", url.strip(), "--engines-file", str(engines), "--requests", "20",
                        "--request-rate", "40", "--arrival", "constant", "--concurrency", "1", "--ttft-slo",
                        "60000", "--baseline", "random", "-o", "json")
        assert result.returncode == 0, result.stderr
        router, baseline = json.loads(result.stdout)
        for report in (router, baseline):
            assert report["completed"] == 20 and report["errors"] == {} and report["peak_in_flight"] == 1
            assert report["offered_per_s"] == 40.0 and report["goodput_per_s"] == report["requests_per_s"] > 0
            assert report["ttft_p50_ms"] <= report["ttft_p90_ms"] <= report["ttft_p99_ms"] <= report["e2e_p99_ms"]
        assert {call: row["count"] for call, row in router["router_calls_ms"].items()} == {
            "route": 20, "prefill_complete": 20, "free": 20}
        assert baseline["router_calls_ms"] == {}


def test_mock_config_out_is_a_serve_config_that_follows_the_engines(tmp_path: Path) -> None:
    config = tmp_path / "fleet.toml"
    with _process("mock", "--engines", "2", "--block-size", "8", "--config-out", str(config), "-o", "json") \
            as (_, rows), \
            _process("serve", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path), "--no-restore",
                     "--config", str(config)) as (_, url):
        engines = {row["worker_id"]: row["url"] for row in json.loads(rows)}
        router = url.strip()
        stats = httpx.get(f"{router}/v1/tree/stats").json()["models"]
        assert stats["mock"]["block_size"] == 8
        deadline = time.monotonic() + 10
        prompt = 0
        while not all(w["blocks"] for w in httpx.get(f"{router}/v1/workers").json()["workers"]):
            assert time.monotonic() < deadline, httpx.get(f"{router}/v1/workers").json()
            prompt += 1  # a new prompt each time: once the router's SUB has joined, its events arrive
            for engine in engines.values():
                httpx.post(f"{engine}/v1/generate", json={"token_ids": [prompt] * 16, "max_tokens": 1})
            time.sleep(0.05)
        workers = httpx.get(f"{router}/v1/workers").json()["workers"]
        # the load asks for the engines' model, read from the same rows; a model with no engine fails it
        engines_file = tmp_path / "engines.json"
        engines_file.write_text(rows)
        load = ("mock", "load", "--server", router, "--engines-file", str(engines_file), "--requests", "10",
                "-o", "json")
        result = _kvctl(*load)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)[0]["completed"] == 10
        # the file --config-out wrote drives the same load: the fleet is described once (issue 37)
        from_config = _kvctl(*load[:5], str(config), *load[6:])
        assert from_config.returncode == 0, from_config.stderr
        assert json.loads(from_config.stdout)[0]["completed"] == 10
        for model, cause in (("default", "model 'default' has no workers to route to; models with workers: "
                                                 "mock (2)"), ("nosuch", "unknown model 'nosuch'")):
            failed = _kvctl(*load, "--model", model)
            assert failed.returncode == 1 and "router: no request completed" in failed.stderr, failed.stderr
            assert cause in failed.stderr and "all_busy" not in failed.stdout
    assert sorted((w["worker_id"], w["model"]) for w in workers) == [(1, "mock"), (2, "mock")]
    assert all(w["replay_endpoint"] and w["rejected_events"] == {} for w in workers)


def test_shared_prefix_is_seeded_and_shares_prefixes() -> None:
    a, b = shared_prefix(50, prefixes=4, prefix_tokens=64, suffix_tokens=16, seed=3), shared_prefix(
        50, prefixes=4, prefix_tokens=64, suffix_tokens=16, seed=3)
    assert a == b
    assert len({tuple(r.tokens[:64]) for r in a}) <= 4 and len({tuple(r.tokens[64:]) for r in a}) == 50


def test_mooncake_trace_keeps_shared_hash_blocks_shared_when_rescaled() -> None:
    rows = [json.loads(line) for line in TRACE.read_text().splitlines()[:30]]
    requests = mooncake_trace(TRACE, block_tokens=8, speed=10, limit=30)
    assert len(requests) == 30
    for row, request in zip(rows, requests, strict=True):
        assert len(request.tokens) == min(len(row["hash_ids"]) * 8, max(1, round(row["input_length"] / 64)))
        assert request.at_s == row["timestamp"] / 1000 / 10
    # the first two requests share hash id 0: their first block of tokens is the same
    assert rows[0]["hash_ids"][0] == rows[1]["hash_ids"][0]
    assert requests[0].tokens[:8] == requests[1].tokens[:8]
    assert requests[0].tokens[8:16] != requests[1].tokens[8:16]


def _children(pid: int) -> list[int]:
    return [int(c) for task in os.listdir(f"/proc/{pid}/task")
            for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]


def _gave_up(proc: subprocess.Popen[str], killed_at: float, give_up_s: float) -> str:
    """The load's process ended with exit 3 and one error line, soon after its router died, having sent few
    calls meanwhile (it used to send ~1,500 a second for as long as it ran, then claim a result)."""
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - killed_at
    assert proc.returncode == 3, err
    assert out == ""  # no result table
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: cannot reach the router at ") and "load stopped" in last, err
    failed = int(re.search(r"(\d+) failed calls", last).group(1))  # type: ignore[union-attr]
    assert took < give_up_s + 4, took
    assert failed / took < 50, (failed, took)
    return last


@pytest.mark.slow
def test_the_demo_ends_in_an_error_when_its_router_dies() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "kvctl", "demo", "--duration", "12", "--engines", "2",
                             "--give-up-after", "2", "-o", "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stderr is not None
    try:
        while not proc.stderr.readline().startswith("[capacity router]"):  # a routed phase runs
            assert proc.poll() is None
        [router] = [c for c in _children(proc.pid) if b"serve" in Path(f"/proc/{c}/cmdline").read_bytes()]
        os.kill(router, signal.SIGKILL)
        _gave_up(proc, time.monotonic(), 2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_mock_load_ends_in_an_error_when_the_router_dies(tmp_path: Path) -> None:
    with _process("serve", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path), "--no-restore") as (serve, url), \
            _process("mock", "--engines", "2", "--capacity", "256", "-o", "json") as (_, rows):
        engines = tmp_path / "engines.json"
        engines.write_text(rows)
        load = subprocess.Popen([sys.executable, "-m", "kvctl", "mock", "load", "--server", url.strip(),
                                 "--engines-file", str(engines), "--requests", "5000", "--concurrency", "8",
                                 "--give-up-after", "2", "-o", "json"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        try:
            while not _routed(url.strip()):  # the load runs
                assert load.poll() is None, load.communicate()
                time.sleep(0.1)
            serve.kill()
            killed = time.monotonic()
            assert "router: " in _gave_up(load, killed, 2)
        finally:
            if load.poll() is None:
                load.kill()
                load.wait()


def _routed(url: str) -> bool:
    """Some requests went through the router to the engines (their blocks are in its index)."""
    return any(w["blocks"] > 0 for w in httpx.get(f"{url}/v1/workers").json()["workers"])


@pytest.mark.slow
def test_demo_table_compares_phases_of_equal_length_and_says_one_engine_has_no_choice() -> None:
    result = _kvctl("demo", "--duration", "8", "--engines", "1", "--request-rate", "5", timeout=120)
    assert result.returncode == 0, result.stderr
    header = next(line.split() for line in result.stdout.splitlines() if line.startswith("PHASE"))
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith(("capacity", "open-loop"))]
    assert [row[:2] for row in rows] == [["capacity", "random"], ["capacity", "router"], ["open-loop", "random"],
                                         ["open-loop", "router"]]
    offered, seconds = header.index("OFFERED"), header.index("SECONDS")
    open_random, open_router = rows[2:]
    assert open_random[offered] == open_router[offered] == "5"
    assert abs(float(open_random[seconds]) - float(open_router[seconds])) < 0.5, result.stdout
    assert any("one engine: there is nothing to choose" in line for line in result.stderr.splitlines())
    assert "None" not in result.stdout + result.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--duration", "3"], "--duration must be at least 4 seconds"),
    (["--ttft-slo", "0"], "--ttft-slo must be > 0 ms"),
    (["--request-rate", "-1"], "--request-rate must be > 0 req/s"),
])
def test_demo_rejects_bad_values_before_starting_anything(args: list[str], message: str) -> None:
    result = _kvctl("demo", *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr
