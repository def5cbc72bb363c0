"""The background loops of an event plane (NATS or ZMQ), watched: one that ends other than by being cancelled
is a bug, and it shows in `/v1/status` as the plane `failed` with its error, not only in the log at exit. A
supervised loop (`_supervise`) is started again after a backoff instead, for ever: a plane never stops for good."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from kvctl.server.logs import error_text

log = logging.getLogger("kvctl.serve")
STOP_TIMEOUT_S = 5.0
"""How long shutdown waits for a plane's loops once cancelled."""
RESTART_MIN_S = 0.5
RESTART_MAX_S = 30.0
"""A supervised loop that died is started again after RESTART_MIN_S, doubled at each death in a row up to this
(a loop that then ran this long without dying starts from the minimum again)."""


class PlaneTasks:
    """Base of a plane: `state`, `last_error`, its loops (`_spawn`), and readiness (`_started`, set by it)."""

    def __init__(self, state: str) -> None:
        self.state = state
        self.last_error: str | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._started = asyncio.Event()

    def _spawn(self, work: Coroutine[Any, Any, None], into: list[asyncio.Task[None]] | None = None,
               name: str | None = None) -> None:
        task = asyncio.get_running_loop().create_task(work, name=name or work.__qualname__)
        task.add_done_callback(self._died)
        (self._tasks if into is None else into).append(task)

    def _supervise(self, work: Callable[[], Coroutine[Any, Any, None]], into: list[asyncio.Task[None]] | None = None,
                   failed: Callable[[str, float], None] | None = None) -> None:
        """Run `work()`, and run it again after a backoff whenever it raises: `failed(error, backoff_s)` is told
        first (the plane raises its fault there), and the error is the plane's `last_error`."""
        name = getattr(getattr(work, "func", work), "__qualname__", repr(work))  # a partial names its function
        self._spawn(self._restarting(work, name, failed), into, name)

    async def _restarting(self, work: Callable[[], Coroutine[Any, Any, None]], name: str,
                          failed: Callable[[str, float], None] | None) -> None:
        loop = asyncio.get_running_loop()
        backoff = RESTART_MIN_S
        while True:
            started = loop.time()
            try:
                await work()
                return
            except Exception as exc:  # a bug, or what its loop did not expect: logged, told, started again
                if loop.time() - started >= RESTART_MAX_S:
                    backoff = RESTART_MIN_S
                self.last_error = error_text(exc)
                log.error("event plane: %s stopped; starting it again in %g s", name, backoff,
                          exc_info=exc)
                if failed is not None:
                    failed(self.last_error, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RESTART_MAX_S)

    def _died(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        assert exc is not None
        self.state = "failed"
        self.last_error = error_text(exc)
        log.error("event plane: %s stopped", task.get_name(), exc_info=exc)

    async def ready(self, timeout: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._started.wait(), timeout)
        return self._started.is_set()

    async def _stop_tasks(self, tasks: list[asyncio.Task[None]] | None = None) -> None:
        """Cancel the loops (the plane's own, or `tasks`) and wait until each has ended, or `STOP_TIMEOUT_S`:
        a loop that swallows its cancellation (a client library's, inside a connect) must not hold shutdown."""
        tasks = self._tasks if tasks is None else tasks
        for task in tasks:
            task.cancel()
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=STOP_TIMEOUT_S)
        for task in pending:
            log.warning("event plane: %s did not stop within %g s of its cancellation; left behind",
                        task.get_name(), STOP_TIMEOUT_S)
