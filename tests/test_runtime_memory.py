"""The heap is trimmed after a burst of applied batches, at most once a second, and never for a trickle."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from kvctl.runtime import BurstTrimmer


def _rss() -> int:
    for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_trims_after_a_burst_at_most_once_per_interval() -> None:
    now = [100.0]
    trimmer = BurstTrimmer(burst=10, every_s=1.0, clock=lambda: now[0])
    trimmer.applied(9)
    trimmer.idle()
    assert trimmer.trims == 0  # a trickle: not worth a trim
    trimmer.applied(1)
    trimmer.idle()
    assert trimmer.trims == 1
    trimmer.applied(50)
    trimmer.idle()
    assert trimmer.trims == 1  # within the interval
    now[0] += 1.0
    trimmer.idle()
    assert trimmer.trims == 2
    trimmer.idle()
    now[0] += 5
    trimmer.idle()
    assert trimmer.trims == 2  # nothing applied since


def test_a_trim_gives_freed_memory_back() -> None:
    """What a burst leaves behind (many freed buffers) comes off the process's RSS."""
    trimmer = BurstTrimmer(burst=1)
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(4096) for _ in range(20_000)]  # ~80 MB in small chunks: no mmap, kept by free()
    for b in blocks:
        ctypes.memset(b, 1, 4096)
    keep = libc.malloc(64)  # above them all, so the heap top cannot simply shrink
    for b in blocks:
        libc.free(b)
    before = _rss()
    trimmer.applied(1)
    trimmer.idle()
    after = _rss()
    libc.free(keep)
    assert trimmer.trims == 1
    assert before - after > 40 * 2**20, (before, after)
