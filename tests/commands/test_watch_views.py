"""`--watch` on doctor, tree stats and busy get: a real `kvctl` process against a real router, refreshing
until Ctrl-C, which ends it with exit 0 as every --watch does."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.commands.live_router import kvctl, loaded_router, url_of


@pytest.fixture(autouse=True)
def ctrl_c_not_ignored() -> Iterator[None]:
    """A suite started in the background (`cmd &` in a script) ignores SIGINT, and so would every kvctl it starts:
    Ctrl-C is what these tests send, so the kvctl processes get the default handling."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    with loaded_router(tmp_path_factory.mktemp("state")) as client:
        yield client


def _documents(proc: subprocess.Popen[str], count: int) -> list[Any]:
    """The first `count` JSON lines the watch printed (each refresh is one)."""
    assert proc.stdout is not None
    return [json.loads(proc.stdout.readline()) for _ in range(count)]


@pytest.mark.parametrize(("command", "key"), [(["doctor"], "findings"), (["tree", "stats"], "workers"),
                                              (["busy", "get"], "thresholds")])
def test_watch_refreshes_until_ctrl_c_then_exits_0(router: httpx.Client, command: list[str], key: str) -> None:
    cmd = [sys.executable, "-m", "kvctl", "--server", url_of(router), *command, "--watch", "--interval", "0.2",
           "-o", "json"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            first, second = _documents(proc, 2)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=15)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert first[key] and second[key]


def test_each_refresh_reads_the_router_again(router: httpx.Client) -> None:
    cmd = [sys.executable, "-m", "kvctl", "--server", url_of(router), "busy", "get", "--watch", "--interval", "0.2",
           "-o", "json"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            (before,) = _documents(proc, 1)
            assert router.post("/busy_threshold", json={"model": "default",
                                                        "active_decode_blocks_threshold": 0.5}).status_code == 200
            while (after := _documents(proc, 1)[0]) == before:
                pass
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=15)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert after["thresholds"][0]["active_decode_blocks_threshold"] == 0.5


def test_tree_stats_cannot_watch_stdin(router: httpx.Client) -> None:
    result = kvctl(router, "tree", "stats", "-", "--watch", input="[]")
    assert result.exit_code == 2 and "stdin can be read only once" in result.stderr
