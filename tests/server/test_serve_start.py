"""What a `kvctl serve` start loads, and when: the port must open within a second of the start (issue 27), and
most of a start is loading Python modules. So the port is bound before the server's own stack (uvicorn, starlette,
prometheus_client, pyzmq, the daemon) loads, and a router without an event plane never loads nats-py, httpx (and
the rich it pulls in), Textual or YAML. Checked on what a real process loads (`-X importtime`), not on timings."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from tests.support import eventually

# `kvctl serve` with a line on stderr as its port opens (the first listen()): `-X importtime` writes each
# module's line as it loads, so the lines before it are what was loaded before the port opened.
BINDING = "-- the port opens --"
MARKED_SERVE = f"""
import socket, sys
listen = socket.socket.listen
def marked(sock, *backlog):
    print({BINDING!r}, file=sys.stderr, flush=True)
    return listen(sock, *backlog)
socket.socket.listen = marked
from kvctl.cli import main
main()
"""
SERVER_STACK = ("uvicorn", "starlette", "prometheus_client", "zmq", "kvctl.server.daemon", "kvctl.server.http")
NOT_ASKED_FOR = ("nats", "httpx", "rich", "textual", "yaml", "kvctl.server.plane.nats_plane",
                 "kvctl.server.plane.zmq_plane", "kvctl.server.plane.dynamo_discovery", "kvctl.nats.jetstream")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], list[str]]:
    """The modules a plain `kvctl serve` loaded before it bound its port, and in its whole life: a start with a
    state dir to restore, a restore, /v1/status and /metrics answered, and a clean stop."""
    state_dir = tmp_path_factory.mktemp("state")
    stderr = state_dir.parent / "serve.stderr"
    cmd = [sys.executable, "-X", "importtime", "-c", MARKED_SERVE, "serve", "--listen", "127.0.0.1:0",
           "--state-dir", str(state_dir)]
    with stderr.open("w") as err, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                                   env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
        try:
            url = proc.stdout.readline().strip()  # type: ignore[union-attr]
            assert url.startswith("http://127.0.0.1:"), stderr.read_text()[-2000:]
            with httpx.Client(base_url=url, timeout=5) as client:
                eventually(lambda: client.get("/readyz").status_code == 200, "the restore to finish")
                assert client.get("/v1/status").json()["event_plane"] is None
                assert "kvctl_index_blocks" in client.get("/metrics").text
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=15) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    lines = stderr.read_text().splitlines()
    names = [line.rsplit("|", 1)[1].strip() if line.startswith("import time:") else line for line in lines]
    bound = names.index(BINDING)
    return names[:bound], names


def _of(packages: tuple[str, ...], modules: list[str]) -> list[str]:
    return [m for m in modules if m.startswith(tuple(f"{p}." for p in packages)) or m in packages]


def test_the_port_opens_before_the_server_stack_loads(loaded: tuple[list[str], list[str]]) -> None:
    before_bind, ever = loaded
    assert _of(SERVER_STACK, ever), "the server stack is expected to load, after the bind"
    assert _of(SERVER_STACK, before_bind) == []


def test_a_router_without_an_event_plane_never_loads_its_packages(loaded: tuple[list[str], list[str]]) -> None:
    _, ever = loaded
    assert _of(NOT_ASKED_FOR, ever) == []
