"""A real `kvctl serve --dynamo-discovery STORE` process for the discovery-limit tests (issue 36), with what they
read of it: its plane's status, its ledger's discovery losses, its peak RSS, `kvctl doctor`'s verdict, and how
long a SIGTERM takes. Its log goes to a file (a pipe nobody reads would block it), and a good publisher (an XPUB
socket here, its record Dynamo's) shows that discovery still works beside the hostile entries."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import zmq

from kvctl.core.events.discovery import ChannelKey, encode_file_name
from tests.doctor.rig import doctor
from tests.server.test_zmq_plane import record_for
from tests.support import eventually


@dataclass
class Router:
    proc: subprocess.Popen[str]
    url: str
    client: httpx.Client
    log: Path

    def status(self) -> dict[str, Any]:
        return dict(self.client.get("/v1/status").json())

    def plane(self) -> dict[str, Any]:
        return dict(self.status()["event_plane"])

    def losses(self) -> dict[str, int]:
        """The ledger's discovery losses, by cause."""
        return {loss["cause"]: loss["count"] for loss in self.status()["health"]["losses"]
                if loss["surface"] == "discovery"}

    def faults(self) -> dict[str, dict[str, Any]]:
        return {fault["part"]: fault for fault in self.status()["health"]["faults"]}

    def connected(self) -> set[str]:
        """The addresses of the channels followed whose socket is connected."""
        return {c["address"] for c in self.plane()["connections"] if c["connected"]}

    def peak_rss_mb(self) -> float:
        """The router's peak resident memory so far (VmHWM): what a hostile entry cost it at its worst."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmHWM in /proc/PID/status")

    def doctor(self) -> tuple[int, dict[str, dict[str, Any]]]:
        """`kvctl doctor`'s exit code (Nagios: 0 OK, 1 WARNING, 2 CRITICAL) and its findings by check."""
        code, report = doctor(self.url)
        return code, {f["check"]: f for f in report["findings"]}

    def stop(self) -> float:
        """SIGTERM; the seconds until it exited (killed, and an AssertionError, past 30 s)."""
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError("kvctl serve still running 30 s after SIGTERM") from None
        return time.monotonic() - started


@contextmanager
def router(tmp: Path, discovery: str, *extra: str, files: int | None = None) -> Iterator[Router]:
    """`kvctl serve` following `discovery`, once it answers HTTP; `files`: its open-file limit, soft and hard."""
    log = tmp / "router.log"
    cmd = [sys.executable, "-m", "kvctl", "serve", "--listen", "127.0.0.1:0", "--state-dir", str(tmp / "state"),
           "--decoder", "inline", "--log-level", "info", "--dynamo-discovery", discovery, *extra]

    def limited() -> None:
        if files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))

    with log.open("w") as err, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                                preexec_fn=limited, env={**os.environ, "PYTHONUNBUFFERED": "1"}
                                                ) as proc:
        try:
            url = proc.stdout.readline().strip()  # type: ignore[union-attr]
            assert url.startswith("http://127.0.0.1:"), log.read_text()
            with httpx.Client(base_url=url, timeout=10) as client:
                yield Router(proc, url, client, log)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


class Publisher:
    """A publisher of kv-events on loopback, as a Dynamo worker's: an XPUB socket and its record."""

    def __init__(self, publisher_id: int = 1) -> None:
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.XPUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.socket.bind_to_random_port('tcp://127.0.0.1')}"
        self.key = ChannelKey("dynamo", "backend", "generate", "kv-events", publisher_id).key
        self.record = record_for("kv-events", publisher_id, self.address)

    def close(self) -> None:
        self.socket.close()
        self.ctx.term()


def file_name(key: str) -> str:
    """A key's file in a file store's event-channel bucket."""
    return encode_file_name(key.removeprefix("v1/event_channels/"))


def channel_record(publisher_id: int, address: str) -> tuple[str, bytes]:
    """A kv-events record of `publisher_id` at `address` (any address, however bad): its key and value."""
    record = json.loads(record_for("kv-events", publisher_id, "tcp://127.0.0.1:1"))
    record["transport"]["config"]["endpoint"] = address
    return ChannelKey("dynamo", "backend", "generate", "kv-events", publisher_id).key, json.dumps(record).encode()


def wait_for(probe: Any, what: str, timeout: float = 20) -> Any:
    return eventually(probe, what, timeout=timeout, interval=0.1)
