"""The loop-lag probe behind kvctl_event_loop_lag_seconds."""

from __future__ import annotations

import asyncio
import contextlib
import time

from kvctl.server.daemon import watch_loop


async def test_a_held_loop_is_observed_as_late_as_it_was_held() -> None:
    lags: list[float] = []
    probe = asyncio.create_task(watch_loop(lags.append, 0.01))
    await asyncio.sleep(0.05)
    quiet = len(lags)
    time.sleep(0.2)  # what a long batch or a full collection would do to the loop
    await asyncio.sleep(0.03)
    probe.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await probe
    held = max(lags[quiet:])
    assert quiet >= 2
    assert held >= 0.15  # a lower bound: a loaded machine only makes the lag longer
    assert max(lags[:quiet]) < held / 2  # the quiet probes saw far less than the hold (~0.01 s against 0.2 s)
