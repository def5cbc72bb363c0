"""Quantiles of latencies, one method everywhere: percentiles of samples as numpy's default (linear) computes
them, which vLLM's benchmark_serving reports with, and quantiles of a Prometheus histogram's buckets as PromQL's
`histogram_quantile` reads them, so that what kvctl prints matches what a dashboard shows."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from kvctl.core.tiers import Sample


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



def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The q-quantile (0..1) of cumulative `(upper bound, count)` buckets, +Inf last, as PromQL computes it:
    linear within the bucket that holds the rank (from 0 for the first bucket), the highest finite bound when
    the rank falls in +Inf. None when the histogram counted nothing."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in ordered:
        if count >= rank:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = upper, count
    return lower


def bucket_increase(name: str, before: Sequence[Sample], after: Sequence[Sample],
                    labels: Mapping[str, str]) -> list[tuple[float, float]]:
    """The `(upper bound, count)` buckets of histogram `name` (its series with `labels`) gained between two
    scrapes of one endpoint: a phase's own histogram."""
    def buckets(samples: Sequence[Sample]) -> dict[float, float]:
        return {float(s.labels["le"]): s.value for s in samples if s.name == f"{name}_bucket"
                and all(s.labels.get(k) == v for k, v in labels.items())}

    start = buckets(before)
    return [(le, count - start.get(le, 0.0)) for le, count in buckets(after).items()]
