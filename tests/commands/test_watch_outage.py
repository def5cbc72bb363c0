"""Every `--watch` outlives its router: a real `kvctl serve` killed and started again on the same port while
`workers`, `router status` and `tree stats` watch it. They used to exit 3 the moment it went away."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO

import pytest

from tests.nats_server import free_port
from tests.server.test_serve_process import serving
from tests.support import eventually

WATCHES = {"workers": ["workers"], "router status": ["router", "status"], "tree stats": ["tree", "stats"]}


@pytest.fixture(autouse=True)
def ctrl_c_not_ignored() -> Iterator[None]:
    """A suite started in the background ignores SIGINT, and so would the kvctl processes it starts."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


class Lines:
    """A stream's lines as they come, read by a thread: a test waits for one without blocking on a pipe."""

    def __init__(self, stream: IO[str]) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self._queue.put(line) for line in iter(stream.readline, "")],
                         daemon=True).start()

    def now(self) -> list[str]:
        while not self._queue.empty():
            self.seen.append(self._queue.get())
        return self.seen


@contextmanager
def watching(url: str, command: list[str]) -> Iterator[tuple[subprocess.Popen[str], Lines, Lines]]:
    cmd = [sys.executable, "-m", "kvctl", "--server", url, *command, "--watch", "--interval", "0.2", "-o", "json"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stderr is not None
            yield proc, Lines(proc.stdout), Lines(proc.stderr)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_every_watch_says_since_when_the_router_is_gone_and_resumes_when_it_is_back(tmp_path: Path) -> None:
    listen = ("--listen", f"127.0.0.1:{free_port()}")
    with ExitStack() as watches:
        with serving(tmp_path, *listen) as (_, client):
            assert client.post("/v1/workers", json={"worker_id": 7}).status_code == 201
            url = str(client.base_url).rstrip("/")
            running = {name: watches.enter_context(watching(url, cmd)) for name, cmd in WATCHES.items()}
            for name, (_, out, _) in running.items():
                eventually(out.now, f"{name}'s first view")
        # the router is killed: each watch keeps going and says since when it cannot reach it
        for name, (proc, _, err) in running.items():
            said = eventually(lambda proc=proc, err=err: (proc.poll(), "".join(err.now())), f"{name} to retry",
                              until=lambda seen: seen[0] is not None or "unreachable since " in seen[1])
            assert said[0] is None, f"{name} exited {said[0]}: {said[1]}"
            assert "retrying every 0.2 s: cannot reach the router at" in said[1]
        with serving(tmp_path, *listen):  # the same port, the same state dir: a restart
            for name, (_, out, err) in running.items():
                before = len(out.now())
                eventually(lambda out=out, before=before: len(out.now()) > before, f"{name} to show the router again",
                           timeout=30)
                eventually(lambda err=err: "answering again at " in "".join(err.now()), f"{name} to say so")
        for name, (proc, out, err) in running.items():
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=15) == 0, f"{name}: {''.join(err.now())}"
            assert all(json.loads(line) for line in out.now())  # stdout stays data: one object a line
            assert "Traceback" not in "".join(err.now())
