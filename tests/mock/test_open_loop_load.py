"""The load generator measuring as serving benchmarks do: open-loop arrivals, client-side latencies, router
call latencies, goodput. Real mock engines on loopback; the router is the real app in-process (`rig`)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from kvctl.client import AsyncRouterClient
from kvctl.client.engine import EngineClient
from kvctl.client.tier_sources import parse_metrics
from kvctl.mock.capacity import capacity
from kvctl.mock.fleet import Fleet
from kvctl.mock.load import Arrival, LoadGenerator, LoadStats, Policy, Request, arrival_offsets, shared_prefix
from tests.mock.test_against_router import BASE, Rig, rig

SLOW = {"max_running": 1, "speedup": 0.25}
"""One request at a time, each ~100 ms (a ~17 ms prefill and a ~6 ms decode step, 4x slower): far slower than
the rates offered below."""
TWO_SLOTS = {"max_running": 2, "speedup": 0.125}
"""Two requests at a time, each ~200 ms: long beside the ~10 ms a request costs the client and router."""


def _workload(count: int) -> list[Request]:
    """Small prompts: two 2-block system prompts, a 1-block suffix each, 2 output tokens."""
    return shared_prefix(count, prefixes=2, prefix_tokens=32, suffix_tokens=16, output_tokens=2)


@contextlib.asynccontextmanager
async def _engines(count: int = 1, **config: object) -> AsyncIterator[dict[int, EngineClient]]:
    """Engines with no router, for the baselines: worker id -> client."""
    async with Fleet([replace(BASE, worker_id=i + 1, **config) for i in range(count)]) as fleet:  # type: ignore[arg-type]
        clients = {info["worker_id"]: EngineClient(info["url"]) for info in fleet.infos()}
        try:
            yield clients
        finally:
            for client in clients.values():
                await client.aclose()


@contextlib.asynccontextmanager
async def _routed(route_path: str, count: int = 2, **config: object) -> AsyncIterator[tuple[LoadGenerator, Rig]]:
    """A load generator whose router is the real app (routing on `route_path`), following `count` real engines;
    and that rig."""
    async with rig([replace(BASE, worker_id=i + 1, **config) for i in range(count)], route_path) as r, \
            AsyncRouterClient(r.url) as router:
        clients = {w: EngineClient(e.url) for w, e in r.engines.items()}
        try:
            yield LoadGenerator(clients, router=router), r
        finally:
            for client in clients.values():
                await client.aclose()


def test_poisson_offsets_have_the_mean_rate_and_the_seed_decides_them() -> None:
    offsets = list(itertools.islice(arrival_offsets(50.0, Arrival.poisson, 7), 5001))
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert 5000 / offsets[-1] == pytest.approx(50.0, rel=0.05)
    gaps = {round(b - a, 9) for a, b in itertools.pairwise(offsets)}
    assert len(gaps) > 4000  # exponential gaps, not a fixed spacing
    assert offsets == list(itertools.islice(arrival_offsets(50.0, Arrival.poisson, 7), 5001))
    assert offsets != list(itertools.islice(arrival_offsets(50.0, Arrival.poisson, 8), 5001))


def test_constant_offsets_are_evenly_spaced() -> None:
    assert list(itertools.islice(arrival_offsets(4.0, Arrival.constant, 0), 5)) == [0, 0.25, 0.5, 0.75, 1.0]
    with pytest.raises(ValueError, match="> 0"):
        next(arrival_offsets(0.0, Arrival.poisson, 0))


async def test_open_loop_sends_each_request_at_its_time_whatever_is_in_flight() -> None:
    """One engine slot, ~100 ms a request, 10 requests offered at 200/s: they pile up at the engine, where a
    closed loop of 2 would never have more than 2 out."""
    async with _engines(**SLOW) as engines:
        load = LoadGenerator(engines)
        opened = await load.run(_workload(10), Policy.random, request_rate=200.0, arrival=Arrival.constant)
        closed = await load.run(_workload(6), Policy.random, concurrency=2)
    assert opened.completed == 10 and opened.errors == {}
    assert opened.peak_in_flight > 5 > SLOW["max_running"]
    assert len(opened.dispatch_lag_ms) == 10 and min(opened.dispatch_lag_ms) >= 0
    report = opened.report()
    assert report["offered_per_s"] == 200.0 and report["dispatch_lag_p99_ms"] is not None
    assert closed.completed == 6 and closed.peak_in_flight == 2
    assert "offered_per_s" not in closed.report() and closed.dispatch_lag_ms == []


async def test_max_concurrency_caps_an_open_loop_and_the_wait_counts_as_lag() -> None:
    async with _engines(**SLOW) as engines:
        stats = await LoadGenerator(engines).run(_workload(6), Policy.random, request_rate=200.0,
                                                 arrival=Arrival.constant, max_concurrency=2)
    assert stats.completed == 6 and stats.peak_in_flight == 2
    # the last ones waited for a slot: at least one full request (~100 ms) behind their arrival
    assert max(stats.dispatch_lag_ms) > min(stats.e2e_ms)


async def test_a_trace_is_sent_at_its_own_timestamps_not_when_a_slot_frees() -> None:
    """Six requests stamped 20 ms apart against one slow slot: open loop, all six are out at once; none is
    sent before its time, and the run lasts at least until the last stamp."""
    trace = [replace(request, at_s=0.02 * i) for i, request in enumerate(_workload(6))]
    async with _engines(**SLOW) as engines:
        stats = await LoadGenerator(engines).run(trace, Policy.random, concurrency=1)
    assert stats.completed == 6 and stats.peak_in_flight > 1
    assert len(stats.dispatch_lag_ms) == 6 and min(stats.dispatch_lag_ms) >= 0
    assert stats.report()["duration_s"] >= 0.1
    assert stats.report()["offered_per_s"] == pytest.approx(50.0)
    with pytest.raises(ValueError, match="own arrival times"):
        await LoadGenerator({1: EngineClient("http://127.0.0.1:1")}).run(trace, Policy.random, request_rate=5.0)


async def test_an_open_loop_window_stops_sending_then_drains_and_counts_what_outlived_the_drain() -> None:
    async with _engines(**SLOW) as engines:
        stats = await LoadGenerator(engines).run(_workload(4), Policy.random, request_rate=100.0, duration_s=0.2,
                                                 arrival=Arrival.constant, drain_s=0.05)
    # 20 arrivals in the window (the workload cycled), one slot of ~100 ms: most were still out at the drain's end
    assert stats.sent == 20
    assert stats.errors["drain_timeout"] == 20 - stats.completed > 0


async def test_latencies_are_the_client_s_and_each_router_call_is_counted_once(route_path: str) -> None:
    async with _routed(route_path) as (load, r):
        stats = await load.run(_workload(8), Policy.router, concurrency=2)
        baseline = await load.run(_workload(4), Policy.random, concurrency=2)
        exposition = (await r.client.get("/metrics")).text
    assert stats.completed == 8 and stats.errors == {}
    calls = stats.report()["router_calls_ms"]
    assert {call: row["count"] for call, row in calls.items()} == {"route": 8, "prefill_complete": 8, "free": 8}
    assert all(0 < row["p50"] <= row["p99"] for row in calls.values())
    # the client's TTFT holds the route call and the engine's own: longer than what the engine reports
    assert len(stats.ttft_ms) == len(stats.engine_ttft_ms) == 8
    assert all(client > engine for client, engine in zip(stats.ttft_ms, stats.engine_ttft_ms, strict=True))
    assert sorted(stats.e2e_ms)[-1] >= sorted(stats.ttft_ms)[-1]
    assert baseline.report()["router_calls_ms"] == {}
    # prefill complete carried what each engine found cached: the router joined all 8 requests' hits
    joined = {name: sum(s.value for s in parse_metrics(exposition) if s.name == f"kvctl_worker_{name}_total")
              for name in ("joined_requests", "observed_cached_blocks")}
    assert joined == {"joined_requests": 8, "observed_cached_blocks": stats.cached_tokens // BASE.block_size}


@pytest.mark.parametrize(("slo_ms", "good"), [(1e-6, 0), (60_000.0, 6)])
async def test_goodput_counts_only_requests_within_the_ttft_slo(slo_ms: float, good: int) -> None:
    async with _engines() as engines:
        load = LoadGenerator(engines)
        stats = await load.run(_workload(6), Policy.random, stats=LoadStats(Policy.random, ttft_slo_ms=slo_ms),
                               request_rate=100.0)
        without = await load.run(_workload(2), Policy.random, request_rate=100.0)
    report = stats.report()
    assert stats.completed == 6 and stats.good == good
    assert report["ttft_slo_ms"] == slo_ms
    assert report["goodput_per_s"] == (report["requests_per_s"] if good else 0.0)
    assert "goodput_per_s" not in without.report()


@pytest.mark.parametrize("policy", [Policy.random, Policy.router])
async def test_capacity_climbs_while_the_slo_holds_and_throughput_grows(policy: Policy, route_path: str) -> None:
    """Two slots: two in flight serve about twice what one does, four no more than two (min_growth 50%, well
    clear of the client's and router's share). A loose SLO: every step met it, the capacity is the best."""
    async with _routed(route_path, 1, **TWO_SLOTS) as (load, _):
        result = await capacity(load, _workload(8), policy, ttft_slo_ms=60_000.0, step_s=0.5,
                                concurrencies=(1, 2, 4, 8), min_growth=0.5)
    assert [step.concurrency for step in result.steps] == [1, 2, 4]
    assert all(step.met_slo for step in result.steps)
    report = result.report()
    assert report["capacity_per_s"] == max(step.requests_per_s for step in result.steps) > 0
    assert report["concurrency"] in (2, 4) and report["steps"][0]["ttft_p90_ms"] > 0


async def test_capacity_stops_at_the_first_step_that_misses_the_slo_and_then_has_none() -> None:
    async with _engines() as engines:
        result = await capacity(LoadGenerator(engines), _workload(4), Policy.random, ttft_slo_ms=1e-6, step_s=0.2,
                                concurrencies=(1, 2, 4))
    [step] = result.steps
    assert step.concurrency == 1 and not step.met_slo and step.requests_per_s > 0
    assert result.report()["capacity_per_s"] is None and result.report()["concurrency"] is None
