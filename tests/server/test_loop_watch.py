"""The loop-lag probe behind kvctl_event_loop_lag_seconds and kvctl_event_loop_blocked_seconds_total."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvctl.server.daemon import watch_loop
from kvctl.server.http.loop_lag import TOLERANCE_S, WINDOW_S, LoopLag
from tests.doctor.rig import doctor, findings
from tests.server.test_serve_process import serving
from tests.support import eventually

STOP_S = 0.5


async def test_a_held_loop_is_observed_as_late_as_it_was_held() -> None:
    lags: list[float] = []
    probe = asyncio.create_task(watch_loop(lags.append, 0.01))
    await asyncio.sleep(0.05)
    quiet = len(lags)
    time.sleep(0.2)  # what a long batch or a full collection would do to the loop
    await asyncio.sleep(0.03)
    probe.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await probe
    held = max(lags[quiet:])
    assert quiet >= 2
    assert held >= 0.15  # a lower bound: a loaded machine only makes the lag longer
    assert max(lags[:quiet]) < held / 2  # the quiet probes saw far less than the hold (~0.01 s against 0.2 s)


def test_a_stall_counts_what_it_held_past_the_tolerance_while_the_histogram_counts_one_probe() -> None:
    now = [100.0]
    lag = LoopLag(CollectorRegistry(), clock=lambda: now[0])
    for _ in range(5999):  # a minute of on-time probes, and one that waited behind a 0.5 s snapshot
        lag.observe(0.001)
    lag.observe(0.5)
    status = lag.status()
    assert status["blocked_s"] == pytest.approx(0.5 - TOLERANCE_S)
    assert status["window_longest_s"] == pytest.approx(0.49) and status["window_stalls"] == status["stalls"] == 1
    assert status["window_blocked_share"] == pytest.approx(0.49 / WINDOW_S, abs=1e-4)
    now[0] += WINDOW_S + 1  # the minute after: the stall leaves the window, not the total
    assert lag.status()["window_blocked_share"] == 0 and lag.status()["blocked_s"] == pytest.approx(0.49)


def test_a_stopped_router_counts_the_stop_as_blocked_time(tmp_path: Path) -> None:
    def blocked() -> float:
        families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
        return families["kvctl_event_loop_blocked_seconds"].samples[0].value

    with serving(tmp_path) as (proc, client):
        assert client.post("/v1/workers", json={"worker_id": 1}).status_code == 201  # else doctor stops at `workers`
        eventually(lambda: client.get("/metrics").text, "the loop probe's first readings",
                   until=lambda text: "kvctl_event_loop_lag_seconds_count" in text)
        before = blocked()
        os.kill(proc.pid, signal.SIGSTOP)  # what a starved host or a long stop-the-world pass does to the loop
        time.sleep(STOP_S)
        os.kill(proc.pid, signal.SIGCONT)
        grown = eventually(lambda: blocked() - before, "the stop counted", until=lambda s: s >= STOP_S - 0.05)
        assert grown < STOP_S + 1.0  # about the stop's length (a loaded machine adds some)
        _, report = doctor(str(client.base_url).rstrip("/"))
    [loop] = findings(report, "loop")
    assert loop["severity"] == "WARNING", loop
    assert loop["evidence"]["window_longest_s"] >= STOP_S - 0.05
