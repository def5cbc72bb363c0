"""Process helpers the end-to-end benchmarks share: a drained server subprocess, its memory and CPU time."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

from kvctl import process_cpu
from kvctl.process_cpu import process_tree

ROOT = Path(__file__).resolve().parents[1]


def rss_bytes(pid: int) -> int:
    """VmRSS of pid and its descendants."""
    total = 0
    for p in process_tree(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of pid and its descendants, every thread: what a phase cost the server,
    whatever share of the cores it got (on a machine the publishers also load, the rates alone mix the two)."""
    seconds = process_cpu.cpu_seconds(pid)
    assert seconds is not None, "the benchmarks read /proc: Linux only"
    return seconds


class Proc:
    """A server subprocess whose output is drained by threads (its first stdout line kept aside)."""

    def __init__(self, argv: list[str]) -> None:
        # As installed: pip compiles bytecode at install, and a process started with PYTHONDONTWRITEBYTECODE set
        # (as some sandboxes and CI images set it) compiles every module at each start (~0.2 s of a restart).
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        self.p = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  stdin=subprocess.DEVNULL, env=env)
        self.lines: list[str] = []
        self.first_line = ""
        self.first = threading.Event()
        for stream in (self.p.stdout, self.p.stderr):
            threading.Thread(target=self._drain, args=(stream, stream is self.p.stdout), daemon=True).start()

    def _drain(self, stream: Any, is_stdout: bool) -> None:
        for raw in stream:
            line = raw.decode(errors="replace").rstrip()
            if is_stdout and not self.first.is_set():
                self.first_line = line
                self.first.set()
            self.lines.append(line)
            del self.lines[:-40]

    def tail(self) -> str:
        return " | ".join(self.lines[-5:])

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)
