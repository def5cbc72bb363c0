"""CPU seconds of a process tree: a grandchild's spinning counts for the child that started it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvctl.process_cpu import cpu_seconds, process_tree
from tests.support import eventually

SPIN = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\ntime.sleep(30)"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_grandchilds_cpu_counts_for_its_grandparent() -> None:
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time\n"
                               f"subprocess.Popen([sys.executable, '-c', {SPIN!r}])\ntime.sleep(30)"])
    try:
        eventually(lambda: cpu_seconds(parent.pid) or 0, "the grandchild's spin counted",
                   until=lambda cpu: cpu >= 0.5, timeout=20, interval=0.1)  # the parent alone: ~0.05 s
        assert len(process_tree(parent.pid)) == 2
        assert (cpu_seconds(parent.pid, descendants=False) or 0) < 0.5  # its own: starting an interpreter
    finally:
        for pid in reversed(process_tree(parent.pid)):
            subprocess.run(["kill", str(pid)], check=False)
        parent.wait()


def test_a_process_that_is_gone_has_no_cpu_time() -> None:
    assert cpu_seconds(2**22 + 12345) is None
