"""How kvctl's long-running processes (the router, its decode process, `kvctl top`, the mock fleet) manage
their own memory: the cyclic collector kept off the hot paths, and freed memory handed back after a burst.

The collector: the router keeps millions of objects (its index) and allocates thousands per batch of events;
`kvctl top` rebuilds a frame of hundreds of rows every second. CPython walks each survivor again in every older
generation, and a full collection walks every live object (the index, Textual's widgets), holding the
event loop for tens of milliseconds. Both freeze what is alive at start; the router also freezes each
young collection's survivors (`survivors_frozen`), `kvctl top` collects less often (`tuned_gc`).

The heap: a burst of engine events passes through memory that is free again once it is applied: ZMQ's receive
buffers (which a burst fills, in the I/O thread's malloc arena), payloads and token lists. glibc keeps freed
memory in its arenas, so without a trim the router's RSS stays at its high-water mark: ~2x the index after
a 100k-block burst, which is what an operator's RSS graph then shows. `malloc_trim` hands the free
pages of every arena back to the kernel; it costs about a millisecond, so it runs only after a burst
(`BurstTrimmer`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

GC_GEN0_THRESHOLD = 10_000
ROUTER_GEN0_THRESHOLD = 1_000
"""Young objects the router lets pile up before walking them: ~1 ms of walking an index's new nodes."""


def tune_gc() -> None:
    """Freeze everything alive now (imported frameworks, a restored index, a mounted UI) out of
    collection, and collect the youngest generation every 10,000 allocations instead of every 700."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])


@contextmanager
def tuned_gc() -> Iterator[None]:
    """`tune_gc` for a while, then the collector as it was: for an app that may run inside another
    process (the TUI's tests run it in pytest's)."""
    before = gc.get_threshold()
    tune_gc()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def _freeze_after_collection(phase: str, info: dict[str, int]) -> None:
    if phase == "stop":
        gc.freeze()


@contextmanager
def survivors_frozen() -> Iterator[None]:
    """Walk each object once, in the youngest generation, and freeze whatever survives that walk.

    The router's survivors are index nodes, thousands per burst of stored blocks, each holding an
    edge's hashes. Left to the older generations, every one of them is walked again, all at once:
    ~90 ms with the loop held after a 1M-block burst, and as often as every 10 s under steady
    traffic. Frozen after their first collection, they are never walked again, and no collection
    walks more than the last `ROUTER_GEN0_THRESHOLD` allocations' survivors (~1 ms).

    What it costs: a reference cycle that becomes garbage after surviving one collection is never
    collected. The index has none (its nodes are unlinked when freed and go by reference counting),
    and the router's request paths leave none that live that long (measured with `gc.DEBUG_SAVEALL`
    over mixed API traffic: the same count after 1 and 4 rounds).
    """
    before = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(ROUTER_GEN0_THRESHOLD, *before[1:])
    gc.callbacks.append(_freeze_after_collection)
    try:
        yield
    finally:
        gc.callbacks.remove(_freeze_after_collection)
        gc.unfreeze()
        gc.set_threshold(*before)


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
