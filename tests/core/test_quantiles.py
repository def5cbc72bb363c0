"""Histogram quantiles by PromQL's rules (linear in the bucket holding the rank, the first bucket from 0, +Inf
answered by the highest finite bound), and a phase's own buckets from two scrapes."""

from __future__ import annotations

import math

import pytest

from kvctl.core.quantiles import bucket_increase, histogram_quantile
from kvctl.core.tiers import Sample

BUCKETS = [(0.001, 10.0), (0.005, 30.0), (0.01, 40.0), (math.inf, 40.0)]


@pytest.mark.parametrize(("q", "expected"), [
    (0.25, 0.001),  # rank 10: the top of the first bucket
    (0.125, 0.0005),  # rank 5: halfway through the first bucket, from 0
    (0.5, 0.003),  # rank 20: halfway from 10 to 30, so 1 ms + 0.5 * 4 ms
    (0.99, 0.0098),  # rank 39.6 in (30, 40]: 5 ms + 0.96 * 5 ms
])
def test_linear_within_the_bucket_that_holds_the_rank(q: float, expected: float) -> None:
    assert histogram_quantile(q, BUCKETS) == pytest.approx(expected)


def test_a_rank_in_the_inf_bucket_is_the_highest_finite_bound() -> None:
    assert histogram_quantile(0.99, [(0.001, 1.0), (0.01, 2.0), (math.inf, 100.0)]) == 0.01


def test_nothing_counted_has_no_quantile() -> None:
    assert histogram_quantile(0.5, [(0.001, 0.0), (math.inf, 0.0)]) is None
    assert histogram_quantile(0.5, []) is None


def test_a_phase_gets_only_the_counts_it_added_for_its_labels() -> None:
    def scrape(counts: list[float], model: str = "default") -> list[Sample]:
        return [Sample("h_bucket", {"model": model, "le": le}, c) for le, c in zip(("0.001", "0.01", "+Inf"), counts)]

    before = scrape([5, 8, 9]) + scrape([100, 100, 100], model="other")
    after = scrape([15, 28, 29]) + scrape([200, 200, 200], model="other")
    assert sorted(bucket_increase("h", before, after, {"model": "default"})) == [
        (0.001, 10.0), (0.01, 20.0), (math.inf, 20.0)]
