"""`kvctl serve` under systemd's `Type=notify`: a real datagram socket in the test's place, a real router process."""

from __future__ import annotations

import logging
import re
import signal
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.server.sd_notify import Notifier, socket_address
from tests.server.test_serve_process import DUMP, serving


@pytest.fixture
def notify_path(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """systemd's side: a datagram socket bound at a path, and the NOTIFY_SOCKET value naming it."""
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        yield sock, str(path)


@pytest.fixture
def notify_abstract() -> Iterator[tuple[socket.socket, str]]:
    """The same in Linux's abstract namespace, which systemd's user managers and containers use: `@name`."""
    name = f"kvctl-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        yield sock, "@" + name


def receive(sock: socket.socket, timeout: float = 30.0) -> dict[str, str]:
    """The next notification, as its fields."""
    sock.settimeout(timeout)
    message = sock.recv(4096).decode()
    return dict(line.split("=", 1) for line in message.splitlines())


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid`, from /proc (the decode process, here)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # a process that ended while we looked
        if ppid == pid:
            found.append(int(stat.parent.name))
    return found


def test_ready_once_answering_then_stopping_on_sigterm(tmp_path: Path, notify_path: tuple[socket.socket, str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    sock, value = notify_path
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    with serving(tmp_path / "state", "--decoder", "process") as (proc, client):
        ready = receive(sock)
        assert client.get("/v1/status", timeout=1.0).status_code == 200  # answering the moment READY=1 arrives
        assert ready == {"READY": "1", "STATUS": f"serving {client.base_url}", "MAINPID": str(proc.pid)}
        decode_process = children_of(proc.pid)
        assert decode_process, "no decode process started"
        for pid in decode_process:
            assert b"NOTIFY_SOCKET=" not in Path(f"/proc/{pid}/environ").read_bytes()
        proc.send_signal(signal.SIGTERM)
        stopping = receive(sock)
        assert stopping["STOPPING"] == "1" and "state log" in stopping["STATUS"]
        assert proc.wait(timeout=15) == 0


def test_abstract_socket_and_ready_after_the_snapshot_is_restored(
        tmp_path: Path, notify_abstract: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state"
    with serving(state) as (proc, client):  # no NOTIFY_SOCKET: no systemd, nothing sent, nothing breaks
        assert client.post("/v1/workers", json={"worker_id": 5}).status_code == 201
        client.post("/v1/events", content=DUMP, headers={"content-type": "application/x-ndjson"})
        tree = client.get("/v1/tree").json()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    sock, value = notify_abstract
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    with serving(state) as (proc, client):
        ready = receive(sock)
        while "READY" not in ready:  # the restore's progress (STATUS= alone) comes first when it takes a slice
            ready = receive(sock)
        assert client.get("/v1/tree", timeout=1.0).json() == tree  # READY=1 came with the index restored
        assert ready["READY"] == "1"
        assert re.fullmatch(rf"serving {client.base_url}, \d+ state log records replayed", ready["STATUS"])
        proc.send_signal(signal.SIGTERM)
        assert receive(sock)["STOPPING"] == "1"
        assert proc.wait(timeout=15) == 0


def test_watchdog_pings_from_the_running_loop(tmp_path: Path, notify_path: tuple[socket.socket, str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    sock, value = notify_path
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # 0.2 s: a ping every 0.1 s
    with serving(tmp_path / "state") as (proc, _):
        seen = [receive(sock) for _ in range(8)]
        assert {"READY": "1"}.items() <= next(m for m in seen if "READY" in m).items()
        assert sum(m == {"WATCHDOG": "1"} for m in seen) >= 6
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0


@pytest.mark.parametrize(("value", "address"), [
    ("/run/systemd/notify", "/run/systemd/notify"),
    ("@kvctl/notify", "\0kvctl/notify"),
    ("vsock:2:1234", None),
    ("relative/notify", None),
    ("@", None),
])
def test_socket_address(value: str, address: str | None) -> None:
    assert socket_address(value) == address


def test_environment_is_taken_and_the_watchdog_is_ours_only() -> None:
    environ = {"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1", "PATH": "/bin"}
    notifier = Notifier.from_environment(environ)
    assert environ == {"PATH": "/bin"}  # nothing left for a child to inherit
    assert notifier.address == "\0x" and notifier.watchdog_s is None  # pid 1's watchdog, not this process's
    assert Notifier.from_environment({"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "30000000"}).watchdog_s == 30.0
    assert Notifier.from_environment({"WATCHDOG_USEC": "30000000"}).watchdog_s is None  # nobody to ping
    assert Notifier.from_environment({}).address is None


def test_a_socket_gone_is_logged_once_never_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    notifier = Notifier(str(tmp_path / "nobody"))
    with caplog.at_level(logging.WARNING, logger="kvctl.serve"):
        notifier.ready("serving")
        notifier.stopping("draining")
    assert [r.getMessage() for r in caplog.records if "NOTIFY_SOCKET" in r.getMessage()] == \
        ["cannot notify systemd at NOTIFY_SOCKET: [Errno 2] No such file or directory"]
