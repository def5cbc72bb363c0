"""Quantiles of latency samples, computed one way everywhere, so that a p99 here means what it means in
serving benchmarks (numpy's default method, which vLLM's benchmark_serving reports with)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def percentiles(values: Iterable[float], qs: Sequence[float]) -> list[float | None]:
    """The `qs` percentiles (each in [0, 100]) of `values`, sorting once: linear interpolation between the
    closest ranks, numpy's default. None for each when there are no values."""
    if any(not 0 <= q <= 100 for q in qs):
        raise ValueError(f"percentiles are in [0, 100], got {list(qs)}")
    ordered = sorted(values)
    if not ordered:
        return [None for _ in qs]
    out: list[float | None] = []
    for q in qs:
        rank = (len(ordered) - 1) * q / 100
        low = math.floor(rank)
        high = min(low + 1, len(ordered) - 1)
        out.append(ordered[low] + (ordered[high] - ordered[low]) * (rank - low))
    return out


def percentile(values: Iterable[float], q: float) -> float | None:
    """The `q` percentile (in [0, 100]) of `values`, as `percentiles` computes it; None for no values."""
    return percentiles(values, (q,))[0]
