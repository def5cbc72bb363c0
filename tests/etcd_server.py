"""A real etcd (Debian's `etcd-server`, 3.4: `.ci/run` installs it) on free loopback ports, in its own data dir,
stopped by its pid; `put` and `delete` go through its JSON gateway, as Dynamo's records would be written."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.nats_server import free_port, stop_process


def _b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


class EtcdServer:
    def __init__(self, data_dir: Path, *flags: str) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            why = "no etcd binary (apt-get install etcd-server; .ci/run installs it)"
            if os.environ.get("KVCTL_REQUIRE_INTEROP") == "1":  # CI: what needs etcd may not skip
                pytest.fail(why, pytrace=False)
            pytest.skip(why)
        self.port, peer = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [binary, "--data-dir", str(data_dir), "--listen-client-urls", self.url, "--advertise-client-urls",
                self.url, "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer}", "--initial-cluster", f"default=http://127.0.0.1:{peer}", *flags]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"etcd did not start on {self.url}")
            time.sleep(0.1)

    def put(self, key: str, value: bytes) -> None:
        answer = httpx.post(f"{self.url}/v3/kv/put", json={"key": _b64(key), "value": _b64(value)}, timeout=30)
        answer.raise_for_status()

    def delete(self, key: str) -> None:
        httpx.post(f"{self.url}/v3/kv/deleterange", json={"key": _b64(key)}, timeout=5).raise_for_status()

    def delete_prefix(self, prefix: str) -> None:
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        httpx.post(f"{self.url}/v3/kv/deleterange", json={"key": _b64(prefix), "range_end": _b64(end)},
                   timeout=5).raise_for_status()

    def stop(self) -> None:
        stop_process(self.proc)
