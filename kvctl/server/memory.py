"""Giving memory back after a burst of engine events.

A burst passes through memory that is free again once it is applied: ZMQ's receive buffers (which a
burst fills, in the I/O thread's malloc arena), payloads and token lists. glibc keeps freed memory
in its arenas, so without a trim the router's RSS stays at its high-water mark: ~2x the index after
a 100k-block burst, which is what an operator's RSS graph then shows. `malloc_trim` hands the free
pages of every arena back to the kernel; it costs about a millisecond, so it runs only after a burst.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable

__all__ = ["BurstTrimmer", "trim_heap"]


def _malloc_trim() -> Callable[[], object] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim with
        return None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


_TRIM = _malloc_trim()


def trim_heap() -> bool:
    """Hand the free pages of every malloc arena back to the system; False where there is no malloc_trim."""
    if _TRIM is None:
        return False
    _TRIM()
    return True


class BurstTrimmer:
    """Call `applied(n)` as batches are applied and `idle()` when the backlog is empty: after at least
    `burst` batches since the last trim, and at most once per `every_s`, the heap is trimmed."""

    def __init__(self, *, burst: int = 256, every_s: float = 1.0, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self._burst = burst
        self._every_s = every_s
        self._clock = clock
        self._since = 0
        self._last = float("-inf")
        self.trims = 0

    def applied(self, batches: int) -> None:
        self._since += batches

    @property
    def due(self) -> bool:
        """A burst went through since the last trim: `idle()` would trim, now or once `every_s` has passed."""
        return self._since >= self._burst

    def idle(self) -> None:
        if self._since < self._burst:
            return
        now = self._clock()
        if now - self._last < self._every_s or not trim_heap():
            return
        self._since = 0
        self._last = now
        self.trims += 1
