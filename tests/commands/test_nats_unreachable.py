"""Every way into NATS (a CLI command, `kvctl mock`, `kvctl serve --nats`) says a server that refuses it in the
one line of `Unreachable`, never with nats-py's traceback: a command exits 3, the router keeps retrying."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures_path import FIXTURES
from tests.nats_server import free_port
from tests.server.test_serve_process import _stop, serving
from tests.support import eventually

DUMP = FIXTURES / "dynamo-1.6.1" / "dump.jsonl"


@pytest.mark.parametrize("argv", [
    ["events", "publish", str(DUMP), "--yes", "--nats", "{url}"],
    ["tree", "dump", "{url}"],
    ["mock", "--format", "dynamo-nats", "--engines", "2", "--duration", "5", "--nats", "{url}"],
], ids=["events publish", "tree dump", "mock"])
def test_a_command_refused_by_nats_says_one_line_and_exits_3(argv: list[str]) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    proc = subprocess.run([sys.executable, "-m", "kvctl", *(arg.format(url=url) for arg in argv)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.startswith(f"error: cannot reach NATS at {url}: ") and proc.stderr.count("\n") == 1, \
        proc.stderr


def test_the_router_refused_by_nats_logs_one_line_and_keeps_trying(tmp_path: Path) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    with serving(tmp_path, "--no-restore", "--nats", url) as (proc, client):
        plane = eventually(lambda: client.get("/v1/status").json()["event_plane"], "the plane refused",
                           until=lambda p: p["last_error"] is not None, timeout=15)
        assert plane["state"] == "connecting" and plane["last_error"].startswith(f"cannot reach NATS at {url}: ")
        err = _stop(proc)
    said = [line for line in err.splitlines() if "NATS" in line]
    assert len(said) == 1 and said[0].endswith(f"event plane: {plane['last_error']}; retrying with backoff up to 10 s")
    assert "Traceback" not in err, err
