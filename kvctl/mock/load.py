"""The load generator: requests against mock engines, placed by the router or by a baseline policy.

With the router, each request is routed with `reserve`, sent to the chosen engine, marked prefill
complete at its first token and freed when done: the router's full request lifecycle. Baselines
(random, round-robin) pick an engine without asking. Either way, what counts is what the engines
report: how much of each prompt they found cached (the achieved prefix hit rate), time to first
token, throughput.

Workloads: a seeded synthetic shared-prefix mix (system prompts reused across requests, a fresh
suffix each), or a Mooncake trace replayed in time, its 512-token hash blocks rescaled.

Load is offered as serving benchmarks offer it (vLLM's benchmark_serving, Dynamo's aiperf): open loop,
each request sent at its arrival time whatever is still in flight (Poisson or evenly spaced at a rate,
or a trace's own timestamps), or closed loop, a fixed number of requests in flight. Latencies are the
client's: from a request's arrival (open loop) or its start (closed loop) to its first token and to
its end, so the router's calls and any lag of the generator itself are in them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from kvctl.client import AsyncRouterClient, calls
from kvctl.client.engine import EngineClient
from kvctl.core.names import DEFAULT_MODEL, format_worker
from kvctl.core.quantiles import percentile, percentiles
from kvctl.core.words import counted
from kvctl.errors import AllBusy, ApiError, KvctlError, Unreachable
from kvctl.runtime import tuned_gc

VOCAB = 32_000
MOONCAKE_BLOCK = 512  # tokens per hash id in the Mooncake traces
GIVE_UP_S = 5.0
"""How long the router may refuse every connection before a run stops with an error (--give-up-after)."""
PROGRESS_S = 0.1
"""How often `mock load` shows its progress: as often as a terminal's progress line redraws."""
BACKOFF_S = (0.05, 1.0)  # the first and the longest wait before a router call while none connects
CONCURRENCY = 16
"""Closed loop: requests in flight (--concurrency)."""
DRAIN_S = 30.0
"""Open loop: how long a run waits, once it stops sending, for the requests still in flight; those left then
are cancelled and counted as `drain_timeout` errors (--drain-timeout)."""
T = TypeVar("T")

ROUTER_CALLS = ("route", "prefill_complete", "free")
"""The router calls of a request's lifecycle, timed one by one as the load generator makes them."""


@dataclass(frozen=True, slots=True)
class Request:
    tokens: list[int]
    max_tokens: int
    at_s: float | None = None  # arrival time from the start (traces); None: as soon as a slot is free


class Policy(StrEnum):
    router = "router"
    random = "random"
    round_robin = "round-robin"


class Arrival(StrEnum):
    """How an open-loop run spaces its requests at a rate: Poisson (exponential gaps, what serving
    benchmarks offer by default) or evenly."""

    poisson = "poisson"
    constant = "constant"


def arrival_offsets(rate: float, arrival: Arrival, seed: int) -> Iterator[float]:
    """Seconds from the start at which requests arrive, `rate` a second on average, the first at 0 (endless).
    Same rate, kind and seed, same offsets: every policy is offered the same load."""
    if not rate > 0:
        raise ValueError(f"a request rate must be > 0, got {rate}")
    rng = random.Random(seed)
    at = 0.0
    for n in itertools.count(1):
        yield at
        at = at + rng.expovariate(rate) if arrival is Arrival.poisson else n / rate


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
    """What the requests saw, accumulated as they finish (read live by `kvctl demo`). Latencies are client-side,
    as serving benchmarks measure them: from a request's scheduled arrival (open loop) or its start (closed
    loop), so TTFT includes the route call and any dispatch lag; `engine_ttft_ms` is what the engine alone
    reported. Goodput counts the completed requests whose TTFT met `ttft_slo_ms`."""

    policy: Policy
    ttft_slo_ms: float | None = None
    started: float = field(default_factory=time.monotonic)
    sent: int = 0  # requests started (placed, or being placed)
    completed: int = 0
    good: int = 0  # completed with a TTFT within ttft_slo_ms
    in_flight: int = 0
    peak_in_flight: int = 0  # open loop: how far requests piled up; closed loop: the concurrency reached
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    engine_ttft_ms: list[float] = field(default_factory=list)
    e2e_ms: list[float] = field(default_factory=list)
    dispatch_lag_ms: list[float] = field(default_factory=list)  # open loop: how late each request was sent
    router_ms: dict[str, list[float]] = field(default_factory=lambda: {call: [] for call in ROUTER_CALLS})
    open_loop: bool = False
    offered_per_s: float | None = None  # open loop: the rate requests arrive at
    first_sent: float | None = None
    last_done: float | None = None
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

    def per_s(self, count: int) -> float:
        """`count` per second of the busy window, the first request sent to the last one completed: the
        benchmarks' throughput, blind to an idle start or a drain."""
        if self.first_sent is None or self.last_done is None or self.last_done <= self.first_sent:
            return 0.0
        return round(count / (self.last_done - self.first_sent), 1)

    def report(self) -> dict[str, Any]:
        """The run in numbers: `ttft_*` and `e2e_*` client-side, `engine_ttft_*` the engine's own, rates over
        `per_s`'s window; `offered_per_s` and `dispatch_lag_p99_ms` only open loop, goodput only with an SLO."""
        elapsed = (self.finished or time.monotonic()) - self.started
        ttft = percentiles(self.ttft_ms, (50, 90, 99))
        e2e = percentiles(self.e2e_ms, (50, 90, 99))
        engine_ttft = percentiles(self.engine_ttft_ms, (50, 99))
        report: dict[str, Any] = {
            "policy": self.policy.value, "completed": self.completed, "hit_rate": round(self.hit_rate, 4),
            "ttft_p50_ms": _ms(ttft[0]), "ttft_p90_ms": _ms(ttft[1]), "ttft_p99_ms": _ms(ttft[2]),
            "e2e_p50_ms": _ms(e2e[0]), "e2e_p90_ms": _ms(e2e[1]), "e2e_p99_ms": _ms(e2e[2]),
            "engine_ttft_p50_ms": _ms(engine_ttft[0]), "engine_ttft_p99_ms": _ms(engine_ttft[1]),
            "requests_per_s": self.per_s(self.completed), "output_tokens_per_s": self.per_s(self.output_tokens),
            "router_calls_ms": {call: _call_row(samples) for call, samples in self.router_ms.items() if samples},
            "peak_in_flight": self.peak_in_flight, "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens, "errors": dict(self.errors), "first_error": self.first_error,
            "duration_s": round(elapsed, 2),
        }
        if self.open_loop:
            report["offered_per_s"] = None if self.offered_per_s is None else round(self.offered_per_s, 1)
            report["dispatch_lag_p99_ms"] = _ms(percentile(self.dispatch_lag_ms, 99))
        if self.ttft_slo_ms is not None:
            report["ttft_slo_ms"] = self.ttft_slo_ms
            report["goodput_per_s"] = self.per_s(self.good)
        return report


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _call_row(samples: list[float]) -> dict[str, Any]:
    """One router call's latency as the generator saw it: median, tail and how many."""
    p50, p99 = percentiles(samples, (50, 99))
    return {"p50": _ms(p50), "p99": _ms(p99), "count": len(samples)}


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
                 model: str = DEFAULT_MODEL, seed: int = 0, give_up_s: float = GIVE_UP_S) -> None:
        """`engines`: worker id -> client; `router` is needed for the router policy only; a run stops with
        `Unreachable` once the router has refused connections for `give_up_s`. `seed` draws the baselines'
        placements and the Poisson arrivals."""
        if not engines:
            raise ValueError("no engines to send requests to")
        self.engines = dict(engines)
        self.router = router
        self.model = model
        self.seed = seed
        self._watch = _RouterWatch(give_up_s)
        self._rng = random.Random(seed)
        self._ids = itertools.count(1)
        self._turn = itertools.cycle(sorted(self.engines))

    async def run(self, workload: Sequence[Request], policy: Policy, *, concurrency: int = CONCURRENCY,
                  duration_s: float | None = None, stats: LoadStats | None = None,
                  request_rate: float | None = None, arrival: Arrival = Arrival.poisson,
                  max_concurrency: int | None = None, drain_s: float = DRAIN_S) -> LoadStats:
        """Send the workload (cycled until `duration_s` when given; a trace plays once).

        Open loop, with a `request_rate` (req/s, spaced by `arrival`) or a workload with arrival times (a
        trace): each request is sent at its time whether or not the earlier ones are done, at most
        `max_concurrency` in flight when given (later ones wait, late); sending stops at the end of
        `duration_s`, then the requests in flight get `drain_s` to finish. Closed loop otherwise:
        `concurrency` requests in flight, each next one sent when one ends.
        Raises `Unreachable` when the router is gone (see `_RouterWatch`), naming what was done and what failed."""
        if policy is Policy.router and self.router is None:
            raise ValueError("the router policy needs a router")
        stats = stats or LoadStats(policy)
        deadline = None if duration_s is None else stats.started + duration_s
        trace = [(request, request.at_s) for request in workload if request.at_s is not None]
        if trace and request_rate is not None:
            raise ValueError("a trace brings its own arrival times")
        if trace and len(trace) < len(workload):
            raise ValueError("either every request has an arrival time (a trace) or none has")
        pending: Iterator[Request] = itertools.cycle(workload) if duration_s is not None else iter(workload)
        if request_rate is not None:
            stats.open_loop, stats.offered_per_s = True, request_rate
            timed = zip(pending, arrival_offsets(request_rate, arrival, self.seed), strict=False)  # endless offsets
            await self._open_loop(timed, policy, stats, deadline, max_concurrency, drain_s)
        elif trace:
            span = max(at for _, at in trace) - min(at for _, at in trace)
            stats.open_loop, stats.offered_per_s = True, (len(trace) - 1) / span if span > 0 else None
            await self._open_loop(trace, policy, stats, deadline, max_concurrency, drain_s)
        else:
            await self._closed_loop(pending, policy, stats, deadline, concurrency)
        stats.finished = time.monotonic()
        self._raise_if_gone(stats)
        return stats

    async def router_reached(self, stats: LoadStats) -> None:
        """Between runs (a run that never calls the router, a baseline, would not notice it died): while no router
        call has connected since the last failed one, call it again (backing off) until one connects, or raise
        `Unreachable` as `run` does once none has for `give_up_s`. `stats`: the last run's, named in the error."""
        while self.router is not None and self._watch.failing_since is not None and not self._watch.gone:
            with contextlib.suppress(KvctlError):
                await self._ask(calls.status(), "status", stats)
        self._raise_if_gone(stats)

    def _raise_if_gone(self, stats: LoadStats) -> None:
        if self._watch.gone:
            raise Unreachable(f"{self._watch.gone} ({stats.policy.value}: {counted(stats.completed, 'request')} "
                              f"done, {sum(stats.errors.values())} failed calls)", hint="is the router still running?")

    async def _closed_loop(self, pending: Iterator[Request], policy: Policy, stats: LoadStats,
                           deadline: float | None, concurrency: int) -> None:
        async def worker() -> None:
            for request in pending:  # shared iterator: each request goes to exactly one worker
                if (deadline is not None and time.monotonic() >= deadline) or self._watch.gone:
                    return
                await self._one(request, policy, stats, time.monotonic())

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    async def _open_loop(self, schedule: Iterable[tuple[Request, float]], policy: Policy, stats: LoadStats,
                         deadline: float | None, max_concurrency: int | None, drain_s: float) -> None:
        """Each request of `schedule` (with its offset from the start) sent as its own task at its time; then
        the ones in flight drained, those still running after `drain_s` cancelled and counted."""
        limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        in_flight: set[asyncio.Task[None]] = set()
        try:
            for request, offset in schedule:
                at = stats.started + offset
                if (deadline is not None and at >= deadline) or self._watch.gone:
                    break
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                task = asyncio.create_task(self._when_free(limit, request, policy, stats, at))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            if in_flight:
                _, late = await asyncio.wait(in_flight, timeout=drain_s)
                if late:
                    stats.errors["drain_timeout"] += len(late)
        finally:
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)

    async def _when_free(self, limit: asyncio.Semaphore | None, request: Request, policy: Policy, stats: LoadStats,
                         arrived: float) -> None:
        """The request once a slot under the cap is free: the wait is part of its dispatch lag and latencies."""
        async with limit or contextlib.nullcontext():
            stats.dispatch_lag_ms.append((time.monotonic() - arrived) * 1e3)
            await self._one(request, policy, stats, arrived)

    async def _one(self, request: Request, policy: Policy, stats: LoadStats, arrived: float) -> None:
        """One request, counted in flight while it runs; its latencies from `arrived` (its arrival, or its start)."""
        stats.sent += 1
        if stats.first_sent is None:
            stats.first_sent = time.monotonic()
        stats.in_flight += 1
        stats.peak_in_flight = max(stats.peak_in_flight, stats.in_flight)
        try:
            await self._lifecycle(request, policy, stats, arrived)
        finally:
            stats.in_flight -= 1

    async def _lifecycle(self, request: Request, policy: Policy, stats: LoadStats, arrived: float) -> None:
        """Placed, generated (with the router told of prefill's end) and freed: what a serving frontend does."""
        request_id = f"load-{next(self._ids)}"
        try:
            worker_id = await self._place(request, policy, request_id, stats)
        except AllBusy:
            stats.errors["all_busy"] += 1
            return
        except KvctlError as exc:
            stats.fail(type(exc).__name__, exc)
            return
        ttft_ms = None
        told: asyncio.Task[None] | None = None  # prefill complete, told while the stream goes on, as a frontend does
        try:
            async for line in self.engines[worker_id].generate(request.tokens, request.max_tokens, request_id):
                if line["event"] == "first_token":
                    ttft_ms = (time.monotonic() - arrived) * 1e3
                    stats.ttft_ms.append(ttft_ms)
                    stats.engine_ttft_ms.append(line["ttft_ms"])
                    stats.prompt_tokens += line["prompt_tokens"]
                    stats.cached_tokens += line["cached_tokens"]
                    if policy is Policy.router:  # with what the engine found cached: the router joins it
                        told = asyncio.create_task(self._router_call(
                            calls.prefill_complete(request_id, self.model, line["cached_tokens"]),
                            "prefill_complete", stats))
                elif line["event"] == "done":
                    stats.e2e_ms.append((time.monotonic() - arrived) * 1e3)
                    stats.output_tokens += line["output_tokens"]
            stats.completed += 1
            stats.last_done = time.monotonic()
            if stats.ttft_slo_ms is not None and ttft_ms is not None and ttft_ms <= stats.ttft_slo_ms:
                stats.good += 1
        except KvctlError as exc:
            stats.fail(f"engine_{type(exc).__name__}", exc)
        finally:
            if told is not None:
                await told  # before free: the router must not see a freed request's prefill end
            if policy is Policy.router:
                await self._router_call(calls.free(request_id, self.model), "free", stats)

    async def _place(self, request: Request, policy: Policy, request_id: str, stats: LoadStats) -> int:
        if policy is Policy.random:
            return self._rng.choice(sorted(self.engines))
        if policy is Policy.round_robin:
            return next(self._turn)
        decision = await self._ask(calls.route(token_ids=request.tokens, model=self.model, request_id=request_id,
                                               reserve=True), "route", stats)
        return decision.worker_id

    async def _router_call(self, call: calls.Call[Any], name: str, stats: LoadStats) -> None:
        try:
            await self._ask(call, name, stats)
        except KvctlError as exc:
            stats.fail(f"router_{type(exc).__name__}", exc)

    async def _ask(self, call: calls.Call[T], name: str, stats: LoadStats) -> T:
        """A router call, after the watch's backoff while the router refuses connections; its wall time (answered
        or not, the backoff left out) counted under `name`."""
        assert self.router is not None
        if self._watch.delay:
            await asyncio.sleep(self._watch.delay)
        sent = time.monotonic()
        try:
            answer = await self.router.send(call)
        except Unreachable as exc:
            self._watch.unreachable(exc)
            raise
        except ApiError:  # it answered
            self._watch.connected()
            raise
        finally:
            if name in stats.router_ms:  # the lifecycle's calls; not `router_reached`'s checks
                stats.router_ms[name].append((time.monotonic() - sent) * 1e3)
        self._watch.connected()
        return answer

    async def clear_caches(self) -> None:
        """Cold caches everywhere, so the next policy starts where the previous one did; announced to the
        router as engines do (AllBlocksCleared), so that it empties their index and sees no restart."""
        await asyncio.gather(*(engine.clear_cache() for engine in self.engines.values()))


async def register_engines(router: AsyncRouterClient, engines: Sequence[Mapping[str, Any]], model: str) -> list[str]:
    """Tell the router about engines (rows of `kvctl mock -o json`) it does not know yet, with their KV-event
    endpoints, so that it subscribes to them; returns those it registered (WORKER:DP), for the user to know."""
    known = {(w.worker_id, w.dp_rank) for w in (await router.send(calls.workers())).workers}
    registered = []
    for row in engines:
        if (row["worker_id"], row.get("dp_rank", 0)) not in known:
            await router.send(calls.register_worker(row["worker_id"], row["endpoint"], model=model,
                                                    dp_rank=row.get("dp_rank", 0),
                                                    replay_endpoint=row["replay_endpoint"]))
            registered.append(format_worker((row["worker_id"], row.get("dp_rank", 0))))
    return registered


async def run_observed(load: LoadGenerator, workload: Sequence[Request], policy: Policy,
                       progress: Callable[[LoadStats], None], every_s: float, *, ttft_slo_ms: float | None = None,
                       **run: Any) -> LoadStats:
    """`load.run(workload, policy, **run)`, with `progress(stats)` every `every_s` seconds while it runs and
    once more at its end: a person sees a long run move. Its goodput counts TTFTs within `ttft_slo_ms`."""
    stats = LoadStats(policy, ttft_slo_ms=ttft_slo_ms)
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
                       policies: list[Policy], concurrency: int | None, model: str, seed: int,
                       registered: Callable[[list[str]], None], token: str | None = None,
                       give_up_s: float = GIVE_UP_S,
                       progress: Callable[[LoadStats], None] = lambda stats: None,
                       **load: Any) -> list[dict[str, Any]]:
    """Engines from --engines-file the router does not know yet are registered first (with their KV-event
    endpoints: the router's admin `token` when it has one), and `registered` told which; then each policy
    runs from cold caches, its `progress(stats)` ten times a second. `concurrency`: the requests in flight
    closed loop (default CONCURRENCY), the most in flight open loop (default: no cap); `load`: the rest of
    `run_observed`'s and `LoadGenerator.run`'s options (request_rate, arrival, ttft_slo_ms, drain_s)."""
    engines = {worker_id: EngineClient(url) for worker_id, url in targets.items()}
    try:
        async with AsyncRouterClient(server, token=token) as router:
            registered(await register_engines(router, rows, model))
            generator = LoadGenerator(engines, router=router, model=model, seed=seed, give_up_s=give_up_s)
            reports = []
            with tuned_gc():  # the workload frozen: a full collection would walk every token list, loop held
                for policy in policies:
                    await generator.clear_caches()  # every policy from cold caches
                    stats = await run_observed(generator, workload, policy, progress, PROGRESS_S,
                                               concurrency=concurrency or CONCURRENCY, max_concurrency=concurrency,
                                               **load)
                    reports.append(stats.report())
            return reports
    finally:
        await asyncio.gather(*(e.aclose() for e in engines.values()))
