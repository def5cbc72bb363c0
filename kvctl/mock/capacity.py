"""Closed-loop capacity: the most a policy serves while its TTFT still meets a target.

Steps of rising concurrency, each `step_s` long, from cold caches at the start only (each step keeps what the
previous one cached, as a server under growing load does). The capacity is the highest throughput among
the steps whose client-side TTFT p90 met the SLO. The climb stops at the first step that misses it, or once
a step's throughput grew less than `min_growth` over the previous one's: more in flight then only queues.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvctl.core.quantiles import percentile
from kvctl.mock.load import PROGRESS_S, LoadGenerator, LoadStats, Policy, Request, run_observed

CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64)
MIN_GROWTH = 0.05
"""A step must serve 5% more than the previous one for the climb to go on: less is noise, not capacity."""


@dataclass(frozen=True, slots=True)
class CapacityStep:
    concurrency: int
    requests_per_s: float
    ttft_p90_ms: float | None
    met_slo: bool
    hit_rate: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    e2e_p50_ms: float | None
    duration_s: float


@dataclass
class Capacity:
    policy: Policy
    ttft_slo_ms: float
    steps: list[CapacityStep] = field(default_factory=list)

    @property
    def best(self) -> CapacityStep | None:
        """The step with the highest throughput among those that met the SLO; None if none did."""
        met = [step for step in self.steps if step.met_slo]
        return max(met, key=lambda step: step.requests_per_s) if met else None

    def report(self) -> dict[str, Any]:
        best = self.best
        return {"policy": self.policy.value, "ttft_slo_ms": self.ttft_slo_ms,
                "capacity_per_s": best and best.requests_per_s, "concurrency": best and best.concurrency,
                "duration_s": round(sum(step.duration_s for step in self.steps), 2),
                "best": best and asdict(best), "steps": [asdict(step) for step in self.steps]}


async def capacity(load: LoadGenerator, workload: Sequence[Request], policy: Policy, *, ttft_slo_ms: float,
                   step_s: float, concurrencies: Sequence[int] = CONCURRENCIES, min_growth: float = MIN_GROWTH,
                   progress: Callable[[LoadStats], None] = lambda stats: None,
                   every_s: float = PROGRESS_S) -> Capacity:
    """Climb `concurrencies` closed loop, `step_s` a step, until a step misses `ttft_slo_ms` (its TTFT p90) or
    stops growing; `progress(stats)` every `every_s` seconds of each step."""
    await load.clear_caches()
    result = Capacity(policy, ttft_slo_ms)
    for concurrency in concurrencies:
        stats = await run_observed(load, workload, policy, progress, every_s, ttft_slo_ms=ttft_slo_ms,
                                   concurrency=concurrency, duration_s=step_s)
        await load.router_reached(stats)  # a step that missed its target because the router died says so
        p90 = percentile(stats.ttft_ms, 90)
        seen = stats.report()
        step = CapacityStep(concurrency, stats.per_s(stats.completed), None if p90 is None else round(p90, 2),
                            p90 is not None and p90 <= ttft_slo_ms, seen["hit_rate"], seen["ttft_p50_ms"],
                            seen["ttft_p99_ms"], seen["e2e_p50_ms"], seen["duration_s"])
        grew = not result.steps or step.requests_per_s >= result.steps[-1].requests_per_s * (1 + min_growth)
        result.steps.append(step)
        if not step.met_slo or not grew:
            break
    return result
