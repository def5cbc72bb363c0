"""`kvctl serve` and its state dir (issue 22, item 5 and "also seen"): one router per state dir, a state
dir that cannot be written refused at start on one line, and only a bind failure called a port problem."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.test_serve_process import _stop, refused, serving


@pytest.fixture
def unwritable(tmp_path: Path) -> Iterator[Path]:
    """A state dir this process cannot write. chmod does not stop root, so as root it is a path below a
    regular file; otherwise a read-only directory that holds a damaged snapshot."""
    if os.geteuid() == 0:
        (tmp_path / "file").write_text("")
        yield tmp_path / "file" / "state"
        return
    state = tmp_path / "state"
    state.mkdir()
    (state / "snapshot.jsonl").write_text('{"schema": "kvctl.snapshot/v2"}\n')
    state.chmod(0o555)
    try:
        yield state
    finally:
        state.chmod(0o755)


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_a_second_router_on_a_state_dir_exits_2_naming_the_holder(tmp_path: Path) -> None:
    with serving(tmp_path, "--snapshot-interval", "0.01") as (holder, client):
        code, _, err = refused("--listen", "127.0.0.1:0", "--state-dir", str(tmp_path))
        line = one_line(err)
        assert code == 2, err
        assert f"pid {holder.pid}" in line and str(client.base_url).rstrip("/") in line and "--state-dir" in line
        assert client.get("/healthz").status_code == 200
        log = _stop(holder)
    assert "failed" not in log  # the holder's snapshots never met the second router's
    with serving(tmp_path) as (proc, client):  # the lock goes with the process that held it
        _stop(proc)


def test_an_unwritable_state_dir_exits_2_on_one_line(unwritable: Path) -> None:
    code, out, err = refused("--listen", "127.0.0.1:0", "--state-dir", str(unwritable))
    line = one_line(err)
    assert code == 2 and out == ""
    assert f"--state-dir {unwritable} is not a writable directory" in line and "listen" not in line


def test_nats_with_an_unwritable_state_dir_exits_2_on_one_line(unwritable: Path) -> None:
    """The router id is kept in the state dir: writing it first must not end in a traceback."""
    code, _, err = refused("--listen", "127.0.0.1:0", "--state-dir", str(unwritable), "--nats", "nats://127.0.0.1:1")
    assert code == 2 and f"--state-dir {unwritable} is not a writable directory" in one_line(err)


def test_a_damaged_snapshot_that_cannot_be_moved_aside_still_lets_the_router_start(tmp_path: Path) -> None:
    (tmp_path / "snapshot.jsonl").write_text('{"schema": "kvctl.snapshot/v2"}\n')  # no trailer
    (tmp_path / "snapshot.jsonl.damaged").mkdir()  # in the way of the move, for root too
    (tmp_path / "snapshot.jsonl.damaged" / "x").write_text("")
    with serving(tmp_path) as (proc, client):
        assert client.get("/v1/tree").json() == []
        log = _stop(proc)
    assert "could not move it aside" in log and "starting with an empty index" in log


def test_only_a_bind_failure_is_called_a_port_problem(tmp_path: Path) -> None:
    with serving(tmp_path / "a") as (proc, client):
        taken = str(client.base_url).removeprefix("http://").rstrip("/")
        code, _, err = refused("--listen", taken, "--state-dir", str(tmp_path / "b"))
        assert code == 2 and f"cannot listen on {taken}" in one_line(err) and "--listen" in err
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
