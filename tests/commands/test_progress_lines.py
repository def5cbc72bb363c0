"""The progress line of `mock load` and `events replay`: drawn on stderr when it is a terminal (a real
pseudo-terminal here), absent from a pipe and with -o json, where a script reads."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.commands.live_router import DUMP, loaded_router, url_of
from tests.server.test_serve_process import serving

DUMP_EVENTS = len(DUMP.splitlines())


def _run(args: list[str], *, terminal: bool, timeout: float = 60) -> tuple[int, str, str]:
    """`kvctl ARGS` with its stderr on a 200-column pseudo-terminal (or a pipe): (status, stdout, stderr)."""
    cmd = [sys.executable, "-m", "kvctl", *args]
    if not terminal:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        return done.returncode, done.stdout, done.stderr
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    chunks: list[bytes] = []
    with subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=follower) as proc:
        os.close(follower)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if select.select([leader], [], [], 0.5)[0]:
                    try:
                        chunk = os.read(leader, 65536)
                    except OSError:  # EIO: the child has closed the terminal (it exited)
                        break
                    if not chunk:
                        break
                    chunks.append(chunk)
            assert proc.stdout is not None
            stdout = proc.stdout.read()
            status = proc.wait(timeout=10)
        finally:
            os.close(leader)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return status, stdout.decode(), b"".join(chunks).decode(errors="replace")


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    with loaded_router(tmp_path_factory.mktemp("state")) as client:
        yield client


@pytest.fixture(scope="module")
def bare_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """A router that knows no worker yet: `mock load` registers the engines."""
    with serving(tmp_path_factory.mktemp("bare"), "--no-restore") as (_, client):
        yield client


@pytest.fixture(scope="module")
def engines_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Two mock engines, as `kvctl mock -o json` lists them."""
    path = tmp_path_factory.mktemp("engines") / "engines.json"
    cmd = [sys.executable, "-m", "kvctl", "mock", "--engines", "2", "--capacity", "256", "-o", "json"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                          text=True) as mock:
        try:
            assert mock.stdout is not None
            path.write_text(mock.stdout.readline())
            yield path
        finally:
            mock.terminate()
            mock.wait(10)


@pytest.mark.parametrize(("terminal", "output"), [(True, []), (False, []), (True, ["-o", "json"])])
def test_mock_load_shows_its_progress_to_a_person_only(bare_router: httpx.Client, engines_file: Path, terminal: bool,
                                                       output: list[str]) -> None:
    status, stdout, stderr = _run(["mock", "load", "--server", url_of(bare_router), "--engines-file", str(engines_file),
                                   "--requests", "40", *output], terminal=terminal)
    assert status == 0, stderr
    if terminal and not output:
        assert "router" in stderr and "40/40" in stderr and "40 sent" in stderr and "req/s" in stderr, stderr
    else:
        assert "sent" not in stderr and "req/s" not in stderr, stderr
    if output:
        assert json.loads(stdout)[0]["completed"] == 40


@pytest.mark.parametrize(("terminal", "output"), [(True, []), (False, []), (True, ["-o", "json"])])
def test_events_replay_shows_its_progress_to_a_person_only(router: httpx.Client, tmp_path: Path, terminal: bool,
                                                           output: list[str]) -> None:
    dump = tmp_path / "dump.jsonl"
    dump.write_text(DUMP)
    status, stdout, stderr = _run(["--server", url_of(router), "events", "replay", str(dump), "--yes", *output],
                                  terminal=terminal)
    assert status == 0, stderr
    if terminal and not output:
        assert f"{DUMP_EVENTS}/{DUMP_EVENTS}" in stderr and f"applied {DUMP_EVENTS}" in stderr, stderr
    else:
        assert "applied" not in stderr and f"{DUMP_EVENTS}/{DUMP_EVENTS}" not in stderr, stderr
