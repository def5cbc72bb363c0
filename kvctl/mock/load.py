"""The load generator: requests against mock engines, placed by the router or by a baseline policy.

With the router, each request is routed with `reserve`, sent to the chosen engine, marked prefill
complete at its first token and freed when done: the router's full request lifecycle. Baselines
(random, round-robin) pick an engine without asking. Either way, what counts is what the engines
report: how much of each prompt they found cached (the achieved prefix hit rate), time to first
token, throughput.

Workloads: a seeded synthetic shared-prefix mix (system prompts reused across requests, a fresh
suffix each), or a Mooncake trace replayed in time, its 512-token hash blocks rescaled.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from kvctl.client import AsyncRouterClient, calls
from kvctl.client.engine import EngineClient
from kvctl.core.words import counted
from kvctl.errors import AllBusy, ApiError, KvctlError, Unreachable

VOCAB = 32_000
MOONCAKE_BLOCK = 512  # tokens per hash id in the Mooncake traces
GIVE_UP_S = 5.0
"""How long the router may refuse every connection before a run stops with an error (--give-up-after)."""
PROGRESS_S = 0.1
"""How often `mock load` shows its progress: as often as a terminal's progress line redraws."""
BACKOFF_S = (0.05, 1.0)  # the first and the longest wait before a router call while none connects


@dataclass(frozen=True, slots=True)
class Request:
    tokens: list[int]
    max_tokens: int
    at_s: float | None = None  # arrival time from the start (traces); None: as soon as a slot is free


class Policy(StrEnum):
    router = "router"
    random = "random"
    round_robin = "round-robin"


def shared_prefix(count: int, *, prefixes: int = 16, prefix_tokens: int = 1024, suffix_tokens: int = 256,
                  output_tokens: int = 16, seed: int = 0) -> list[Request]:
    """`count` requests, each one of `prefixes` system prompts plus its own suffix; same seed, same list."""
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(prefix_tokens)] for _ in range(prefixes)]
    return [Request(rng.choice(systems) + [rng.randrange(VOCAB) for _ in range(suffix_tokens)], output_tokens)
            for _ in range(count)]


def mooncake_trace(path: Path, *, block_tokens: int = 64, speed: float = 1.0, limit: int | None = None,
                   max_output_tokens: int = 64) -> list[Request]:
    """A Mooncake trace with every 512-token hash block shrunk to `block_tokens` (lengths scale alike):
    equal hash ids still mean an equal prefix. Arrival times are divided by `speed`."""
    scale = block_tokens / MOONCAKE_BLOCK
    blocks: dict[int, list[int]] = {}
    out = []
    with path.open() as f:
        for line in itertools.islice(f, limit):
            row = json.loads(line)
            tokens: list[int] = []
            for hash_id in row["hash_ids"]:
                block = blocks.get(hash_id)
                if block is None:
                    rng = random.Random(hash_id)
                    block = blocks[hash_id] = [rng.randrange(VOCAB) for _ in range(block_tokens)]
                tokens += block
            length = max(1, round(row["input_length"] * scale))
            out.append(Request(tokens[:length], max(1, min(max_output_tokens, round(row["output_length"] * scale))),
                               row["timestamp"] / 1000.0 / speed))
    return out


@dataclass
class LoadStats:
    """What the engines reported, accumulated as requests finish (read live by `kvctl demo`)."""

    policy: Policy
    started: float = field(default_factory=time.monotonic)
    sent: int = 0  # requests started (placed, or being placed)
    completed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    first_error: str | None = None  # the first failure other than all busy: the cause a failed run names
    finished: float | None = None

    def fail(self, kind: str, exc: Exception) -> None:
        """Count a failed call by kind, keeping the first one's message."""
        self.errors[kind] += 1
        self.first_error = self.first_error or str(exc)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def report(self) -> dict[str, Any]:
        elapsed = (self.finished or time.monotonic()) - self.started
        ttft = sorted(self.ttft_ms)
        return {
            "policy": self.policy.value, "completed": self.completed, "hit_rate": round(self.hit_rate, 4),
            "ttft_p50_ms": round(statistics.median(ttft), 2) if ttft else None,
            "ttft_p99_ms": round(ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 2) if ttft else None,
            "requests_per_s": round(self.completed / elapsed, 1) if elapsed > 0 else 0.0,
            "output_tokens_per_s": round(self.output_tokens / elapsed, 1) if elapsed > 0 else 0.0,
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "errors": dict(self.errors), "first_error": self.first_error, "duration_s": round(elapsed, 2),
        }


class _RouterWatch:
    """Router calls that could not connect, in a row. Each next call waits longer (up to BACKOFF_S[1], shared
    by all the run's workers), and once none has connected for `give_up_s` the run stops: a router that died
    costs a few calls a second rather than thousands, and the run ends in an error rather than a result."""

    def __init__(self, give_up_s: float) -> None:
        self.give_up_s = give_up_s
        self.failing_since: float | None = None
        self.failures = 0
        self.delay = 0.0
        self.gone: str | None = None  # why the run stops

    def connected(self) -> None:
        self.failing_since, self.failures, self.delay = None, 0, 0.0

    def unreachable(self, exc: Unreachable) -> None:
        now = time.monotonic()
        self.failing_since = now if self.failing_since is None else self.failing_since
        self.failures += 1
        self.delay = min(BACKOFF_S[1], max(BACKOFF_S[0], 2 * self.delay))
        if self.gone is None and now - self.failing_since >= self.give_up_s:
            self.gone = (f"{exc.message}: no call connected for {self.give_up_s:g} s ({self.failures} in a row), "
                         "load stopped")


class LoadGenerator:
    def __init__(self, engines: Mapping[int, EngineClient], *, router: AsyncRouterClient | None = None,
                 model: str = "default", seed: int = 0, give_up_s: float = GIVE_UP_S) -> None:
        """`engines`: worker id -> client; `router` is needed for the router policy only; a run stops with
        `Unreachable` once the router has refused connections for `give_up_s`."""
        if not engines:
            raise ValueError("no engines to send requests to")
        self.engines = dict(engines)
        self.router = router
        self.model = model
        self._watch = _RouterWatch(give_up_s)
        self._rng = random.Random(seed)
        self._ids = itertools.count(1)
        self._turn = itertools.cycle(sorted(self.engines))

    async def run(self, workload: Sequence[Request], policy: Policy, *, concurrency: int = 16,
                  duration_s: float | None = None, stats: LoadStats | None = None) -> LoadStats:
        """Send the workload (cycled until `duration_s` when given), at most `concurrency` at a time;
        requests with arrival times wait for them. Raises `Unreachable` when the router is gone (see
        `_RouterWatch`), naming what was done and what failed."""
        if policy is Policy.router and self.router is None:
            raise ValueError("the router policy needs a router")
        stats = stats or LoadStats(policy)
        deadline = None if duration_s is None else stats.started + duration_s
        pending: Iterator[Request] = itertools.cycle(workload) if duration_s is not None else iter(workload)

        async def worker() -> None:
            for request in pending:  # shared iterator: each request goes to exactly one worker
                if (deadline is not None and time.monotonic() >= deadline) or self._watch.gone:
                    return
                if request.at_s is not None:
                    await asyncio.sleep(max(0.0, stats.started + request.at_s - time.monotonic()))
                await self._one(request, policy, stats)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        stats.finished = time.monotonic()
        if self._watch.gone:
            raise Unreachable(f"{self._watch.gone} ({policy.value}: {counted(stats.completed, 'request')} done, "
                              f"{sum(stats.errors.values())} failed calls)",
                              hint="is the router still running?")
        return stats

    async def _one(self, request: Request, policy: Policy, stats: LoadStats) -> None:
        request_id = f"load-{next(self._ids)}"
        stats.sent += 1
        try:
            worker_id = await self._place(request, policy, request_id)
        except AllBusy:
            stats.errors["all_busy"] += 1
            return
        except KvctlError as exc:
            stats.fail(type(exc).__name__, exc)
            return
        try:
            async for line in self.engines[worker_id].generate(request.tokens, request.max_tokens, request_id):
                if line["event"] == "first_token":
                    stats.prompt_tokens += line["prompt_tokens"]
                    stats.cached_tokens += line["cached_tokens"]
                    stats.ttft_ms.append(line["ttft_ms"])
                    if policy is Policy.router:
                        await self._router_call(calls.prefill_complete(request_id, self.model), stats)
                elif line["event"] == "done":
                    stats.output_tokens += line["output_tokens"]
            stats.completed += 1
        except KvctlError as exc:
            stats.fail(f"engine_{type(exc).__name__}", exc)
        finally:
            if policy is Policy.router:
                await self._router_call(calls.free(request_id, self.model), stats)

    async def _place(self, request: Request, policy: Policy, request_id: str) -> int:
        if policy is Policy.random:
            return self._rng.choice(sorted(self.engines))
        if policy is Policy.round_robin:
            return next(self._turn)
        decision = await self._ask(calls.route(token_ids=request.tokens, model=self.model, request_id=request_id,
                                               reserve=True))
        return int(decision["worker_id"])

    async def _router_call(self, call: calls.Call, stats: LoadStats) -> None:
        try:
            await self._ask(call)
        except KvctlError as exc:
            stats.fail(f"router_{type(exc).__name__}", exc)

    async def _ask(self, call: calls.Call) -> Any:
        """A router call, after the watch's backoff while the router refuses connections."""
        assert self.router is not None
        if self._watch.delay:
            await asyncio.sleep(self._watch.delay)
        try:
            answer = await self.router.send(call)
        except Unreachable as exc:
            self._watch.unreachable(exc)
            raise
        except ApiError:  # it answered
            self._watch.connected()
            raise
        self._watch.connected()
        return answer

    async def clear_caches(self) -> None:
        """Cold caches everywhere, so the next policy starts where the previous one did; announced to the
        router as engines do (AllBlocksCleared), so that it empties their index and sees no restart."""
        await asyncio.gather(*(engine.clear_cache() for engine in self.engines.values()))


async def register_engines(router: AsyncRouterClient, engines: Sequence[Mapping[str, Any]], model: str) -> list[str]:
    """Tell the router about engines (rows of `kvctl mock -o json`) it does not know yet, with their KV-event
    endpoints, so that it subscribes to them; returns those it registered (WORKER:DP), for the user to know."""
    known = {(w["worker_id"], w["dp_rank"]) for w in (await router.send(calls.workers()))["workers"]}
    registered = []
    for row in engines:
        if (row["worker_id"], row.get("dp_rank", 0)) not in known:
            await router.send(calls.register_worker(row["worker_id"], row["endpoint"], model=model,
                                                    dp_rank=row.get("dp_rank", 0),
                                                    replay_endpoint=row["replay_endpoint"]))
            registered.append(f"{row['worker_id']}:{row.get('dp_rank', 0)}")
    return registered


async def run_observed(load: LoadGenerator, workload: Sequence[Request], policy: Policy,
                       progress: Callable[[LoadStats], None], every_s: float, **run: Any) -> LoadStats:
    """`load.run(workload, policy, **run)`, with `progress(stats)` every `every_s` seconds while it runs and
    once more at its end: a person sees a long run move."""
    stats = LoadStats(policy)
    task = asyncio.create_task(load.run(workload, policy, stats=stats, **run))
    try:
        while not task.done():
            await asyncio.wait([task], timeout=every_s)
            progress(stats)
        return task.result()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def run_policies(server: str, targets: dict[int, str], rows: list[dict[str, Any]], workload: list[Request],
                       policies: list[Policy], concurrency: int, model: str, seed: int,
                       registered: Callable[[list[str]], None], token: str | None = None,
                       give_up_s: float = GIVE_UP_S,
                       progress: Callable[[LoadStats], None] = lambda stats: None) -> list[dict[str, Any]]:
    """Engines from --engines-file the router does not know yet are registered first (with their KV-event
    endpoints: the router's admin `token` when it has one), and `registered` told which; then each policy
    runs from cold caches, its `progress(stats)` ten times a second."""
    engines = {worker_id: EngineClient(url) for worker_id, url in targets.items()}
    try:
        async with AsyncRouterClient(server, token=token) as router:
            registered(await register_engines(router, rows, model))
            load = LoadGenerator(engines, router=router, model=model, seed=seed, give_up_s=give_up_s)
            reports = []
            for policy in policies:
                await load.clear_caches()  # every policy from cold caches
                stats = await run_observed(load, workload, policy, progress, PROGRESS_S, concurrency=concurrency)
                reports.append(stats.report())
            return reports
    finally:
        await asyncio.gather(*(e.aclose() for e in engines.values()))
