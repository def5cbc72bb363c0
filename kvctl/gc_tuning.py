"""The cyclic garbage collector kept off the hot paths of kvctl's long-running processes.

The router applies batches that allocate thousands of objects each; `kvctl top` rebuilds a frame of
hundreds of rows every second. With CPython's default thresholds the young generations are collected
every 700 allocations (~30% of the router's apply time), and a full collection walks every live object
(the index, Textual's widgets), holding the event loop for tens of milliseconds.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

GC_GEN0_THRESHOLD = 10_000


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
