"""One mock engine's GPU: a step scheduler, as vLLM's and Dynamo's mocker's are.

Requests wait in a FIFO queue. Each step (one forward pass) admits them while fewer than `max_running` run and the
step's prefill tokens stay within `max_batched_tokens` (a longer prompt is prefilled in chunks over several steps:
chunked prefill), then lasts what the timing model gives the whole step: every prefill it computes plus one decode
step when a request is decoding. Requests on one engine share its time, so a cache hit shortens a prefill and frees
the engine for the others, while decoding requests advance together. The loop runs only while there is work.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable

from kvctl.mock.timing import TimingModel


class Job:
    """One request: `admit()` runs when it leaves the queue (the cache allocation) and returns the tokens it must
    prefill; `release()` runs once when it finishes or is discarded after admission."""

    def __init__(self, max_tokens: int, admit: Callable[[], int], release: Callable[[], None]) -> None:
        self.max_tokens = max_tokens
        self._admit = admit
        self._release = release
        self.admitted = False
        self.to_prefill = 0
        self.chunk = 0
        """Prefill tokens scheduled in the current step."""
        self.generated = 0
        self.error: Exception | None = None
        self.first_token = asyncio.Event()
        self.finished = asyncio.Event()

    async def until(self, event: asyncio.Event) -> None:
        """Wait for `first_token` or `finished`; raises what its admission raised."""
        await event.wait()
        if self.error is not None:
            raise self.error

    def admit(self) -> bool:
        try:
            self.to_prefill = self._admit()
        except Exception as exc:  # the request fails, the engine goes on
            self.error = exc
            self.first_token.set()
            self.finished.set()
            return False
        self.admitted = True
        return True

    def release(self) -> None:
        if self.admitted:
            self.admitted = False
            self._release()


class StepScheduler:
    """The waiting queue and running batch of one engine, stepped while there is work."""

    def __init__(self, timing: TimingModel, *, max_running: int, max_batched_tokens: int,
                 kv_usage: Callable[[], float], stepped: Callable[[int], None], slowdown: float = 1.0) -> None:
        """`kv_usage()` is active / total KV blocks, for the decode step; `stepped(tokens)` hears of every step
        done and the tokens it computed (prefill and decode); `slowdown` multiplies every step's time."""
        self.timing = timing
        self.max_running = max_running
        self.max_batched_tokens = max_batched_tokens
        self._kv_usage = kv_usage
        self._stepped = stepped
        self._slowdown = slowdown
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []
        self._task: asyncio.Task[None] | None = None

    @property
    def stepping(self) -> bool:
        """Whether the step loop runs: only while some request waits or runs."""
        return self._task is not None

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def submit(self, max_tokens: int, admit: Callable[[], int], release: Callable[[], None]) -> Job:
        """Queue a request; await `job.until(job.first_token)`, then `job.until(job.finished)`."""
        job = Job(max_tokens, admit, release)
        self._waiting.append(job)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())
        return job

    def discard(self, job: Job) -> None:
        """Take a job out wherever it is (its client went away, or it finished): its slot and blocks are free."""
        if job in self._waiting:
            self._waiting.remove(job)
        if job in self._running:
            self._running.remove(job)
        job.release()

    async def close(self) -> None:
        """Stop stepping, even in the middle of a step."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        try:
            while self._waiting or self._running:
                step_ms, tokens = self._plan()
                await asyncio.sleep(step_ms * self._slowdown / 1e3)
                self._advance()
                self._stepped(tokens)
        finally:
            self._task = None

    def _plan(self) -> tuple[float, int]:
        """Schedule one step, running requests' chunked prefills first, then admissions; returns its ms and the
        tokens it computes."""
        budget = self.max_batched_tokens
        step_ms = 0.0
        for job in self._running:
            if not job.generated:
                job.chunk = min(job.to_prefill, budget)
                budget -= job.chunk
                step_ms += self.timing.prefill_ms(job.chunk)
        decoding = sum(1 for job in self._running if job.generated)
        while self._waiting and len(self._running) < self.max_running and budget > 0:
            job = self._waiting.popleft()
            if not job.admit():
                continue
            job.chunk = min(job.to_prefill, budget)
            budget -= job.chunk
            step_ms += self.timing.prefill_ms(job.chunk)
            self._running.append(job)
        if decoding:
            step_ms += self.timing.decode_step_ms(self._kv_usage())
        return step_ms, self.max_batched_tokens - budget + decoding

    def _advance(self) -> None:
        """The step is over: finished prefills give their first token, decoding requests one token each."""
        for job in self._running:
            if job.generated:
                job.generated += 1
            else:
                job.to_prefill -= job.chunk
                if job.to_prefill:
                    continue
                job.generated = 1
                job.first_token.set()
            if job.generated >= job.max_tokens:
                job.finished.set()
                job.release()
        self._running = [job for job in self._running if not job.finished.is_set()]
