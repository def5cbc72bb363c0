"""The cyclic garbage collector kept off the hot paths of kvctl's long-running processes.

The router keeps millions of objects (its index) and allocates thousands per batch of events; `kvctl top`
rebuilds a frame of hundreds of rows every second. CPython walks each survivor again in every older
generation, and a full collection walks every live object (the index, Textual's widgets), holding the
event loop for tens of milliseconds. Both freeze what is alive at start; the router also freezes each
young collection's survivors (`survivors_frozen`), `kvctl top` collects less often (`tuned_gc`).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
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
