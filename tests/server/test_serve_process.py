"""`kvctl serve` as a real process: prints its bound URL first, answers, stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest
from typer.testing import CliRunner

from kvctl.cli import app


def test_serve_announces_url_answers_and_stops_on_sigterm() -> None:
    with subprocess.Popen([sys.executable, "-m", "kvctl", "serve", "--listen", "127.0.0.1:0"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
        _check_serving_then_stop(proc)


def _check_serving_then_stop(proc: subprocess.Popen[str]) -> None:
    try:
        url = proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
        with httpx.Client(base_url=url, timeout=5) as client:
            assert client.get("/healthz").json()["status"] == "ok"
            assert client.post("/v1/workers", json={"worker_id": 5}).status_code == 201
            assert [w["worker_id"] for w in client.get("/v1/workers").json()["workers"]] == [5]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(("args", "needle"), [
    (["serve", "--listen", "0.0.0.0:0"], "without --admin-token"),
    (["serve", "--listen", "7433"], "HOST:PORT"),
    (["serve", "--worker", "x=tcp://a:1"], "--worker wants"),
    (["serve", "--worker", "1=tcp://127.0.0.1:1,bogus=2"], "unknown option 'bogus'"),
    (["serve", "--block-size", "0"], "--block-size must be positive"),
])
def test_bad_serve_arguments_exit_2(args: list[str], needle: str) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and needle in result.stderr
