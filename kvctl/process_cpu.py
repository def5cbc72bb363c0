"""CPU time of a process and its descendants, read from Linux's /proc: what a phase cost each of the demo's
processes, whatever share of the cores each got (the benchmarks read it too)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def process_tree(pid: int) -> list[int]:
    """pid and its live descendants (every thread's children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{p}/task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
    return out


def cpu_seconds(pid: int, *, descendants: bool = True) -> float | None:
    """User + system CPU seconds of pid (and its descendants) so far; None where there is no /proc to read."""
    if not Path(f"/proc/{pid}/stat").exists():
        return None
    ticks = 0
    for p in process_tree(pid) if descendants else [pid]:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of proc(5)
    return ticks / os.sysconf("SC_CLK_TCK")
