"""A plane's loop that swallows its cancellation (a client library's, caught inside a connect) cannot hold the
router's shutdown: the plane waits `STOP_TIMEOUT_S` for it, says so, and goes on."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvctl.server.plane import tasks


async def _stubborn(released: asyncio.Event) -> None:
    while not released.is_set():
        try:
            await released.wait()
        except asyncio.CancelledError:
            continue  # what a library that catches too much does to a cancellation


async def test_a_loop_that_ignores_its_cancellation_is_left_behind_after_the_timeout(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(tasks, "STOP_TIMEOUT_S", 0.2)
    released = asyncio.Event()
    plane = tasks.PlaneTasks("connecting")
    plane._spawn(_stubborn(released))
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="kvctl.serve"):
        await asyncio.wait_for(plane._stop_tasks(), 3.0)  # shutdown goes on, in about the timeout
    assert "_stubborn did not stop within 0.2 s of its cancellation" in caplog.text
    released.set()  # the test's own clean-up: the loop ends once released
    await asyncio.gather(*plane._tasks)


async def test_a_supervised_loop_that_dies_is_started_again_with_a_growing_backoff(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A plane's loop once died for good on a bug (a record ZMQ could not connect to), the plane silent after: a
    supervised loop is told of each death, with the backoff before it runs again, and runs again."""
    monkeypatch.setattr(tasks, "RESTART_MIN_S", 0.01)
    runs: list[int] = []
    told: list[tuple[str, float]] = []
    done = asyncio.Event()

    async def loop() -> None:
        runs.append(len(runs))
        if len(runs) <= 3:
            raise RuntimeError(f"death {len(runs)}")
        done.set()
        await asyncio.Event().wait()  # then it runs, until cancelled

    plane = tasks.PlaneTasks("connecting")
    plane._supervise(loop, failed=lambda error, backoff: told.append((error, backoff)))
    await asyncio.wait_for(done.wait(), 10)
    assert told == [("RuntimeError: death 1", 0.01), ("RuntimeError: death 2", 0.02), ("RuntimeError: death 3", 0.04)]
    assert plane.last_error == "RuntimeError: death 3" and plane._tasks[0].get_name().endswith("loop")
    await plane._stop_tasks()
    assert plane._tasks[0].cancelled()
