"""`eventually` returns the first value that holds and, when none does, says what it waited for."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.support import eventually, eventually_async


def test_returns_the_first_value_that_holds() -> None:
    counter = itertools.count()
    assert eventually(lambda: next(counter), "the third call", until=lambda n: n >= 2, interval=0) == 2


def test_a_timeout_names_what_was_awaited_and_the_last_value() -> None:
    with pytest.raises(AssertionError, match=r"timed out after 0.05 s waiting for the answer; last seen: \[\]"):
        eventually(list, "the answer", timeout=0.05)


async def test_async_awaits_the_probe_and_sees_other_tasks_progress() -> None:
    seen: list[int] = []

    async def fill() -> None:
        for n in range(3):
            seen.append(n)
            await asyncio.sleep(0)

    task = asyncio.create_task(fill())
    assert await eventually_async(lambda: len(seen), "three values", until=lambda n: n == 3) == 3
    await task

    async def answer() -> str:
        return "ready"

    assert await eventually_async(answer, "an awaited probe") == "ready"


async def test_async_timeout_names_what_was_awaited_and_the_last_value() -> None:
    with pytest.raises(AssertionError, match="waiting for nothing; last seen: 0"):
        await eventually_async(lambda: 0, "nothing", timeout=0.05)
