"""Wait until something holds, instead of sleeping a guessed time: the tests' one polling loop.

A fixed sleep is either too short on a loaded machine (a flaky test) or too long everywhere (a slow one);
polling returns as soon as the condition holds and, when it never does, fails saying what was awaited and
the last value seen, which is what a reader of a CI log needs.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

TIMEOUT_S = 60.0
"""How long a condition may take to hold before the test fails: a bound on a hang, never an expectation of speed.
10 s was met on a quiet machine and missed beside two busy loops (a compaction child starting, a restore); the
wait ends as soon as the condition holds, so a passing test pays nothing for the margin."""
INTERVAL_S = 0.02


def _truthy(value: object) -> bool:
    return bool(value)


def _failure(what: str, timeout: float, last: object) -> AssertionError:
    return AssertionError(f"timed out after {timeout:g} s waiting for {what}; last seen: {last!r}")


def eventually(probe: Callable[[], T], what: str, *, until: Callable[[T], bool] = _truthy,
               timeout: float = TIMEOUT_S, interval: float = INTERVAL_S) -> T:
    """Call `probe` until `until` holds of its value (by default: the value is truthy) and return that value;
    after `timeout` seconds raise AssertionError naming `what` and the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if until(value):
            return value
        if time.monotonic() > deadline:
            raise _failure(what, timeout, value)
        time.sleep(interval)


async def eventually_async(probe: Callable[[], T | Awaitable[T]], what: str, *,
                           until: Callable[[T], bool] = _truthy, timeout: float = TIMEOUT_S,
                           interval: float = INTERVAL_S) -> T:
    """`eventually` inside an event loop: `probe` may be a plain function (state the loop's tasks change) or
    return an awaitable (an HTTP call), and the wait yields to the loop between calls."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = probe()
        if inspect.isawaitable(value):
            value = await value
        if until(value):  # type: ignore[arg-type]
            return value  # type: ignore[return-value]
        if loop.time() > deadline:
            raise _failure(what, timeout, value)
        await asyncio.sleep(interval)
