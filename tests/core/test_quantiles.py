"""Percentiles as numpy's default (linear) method computes them (the expected values are numpy's); histogram
quantiles by PromQL's rules (linear in the bucket holding the rank, the first bucket from 0, +Inf answered by the
highest finite bound); a phase's own buckets from two scrapes."""

from __future__ import annotations

import math

import pytest

from kvctl.core.quantiles import bucket_increase, histogram_quantile, percentile, percentiles
from kvctl.core.tiers import Sample


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([1, 2, 3, 4], 50, 2.5),  # between the two middle ranks, not the upper one
        ([1, 2, 3, 4], 90, 3.7),
        ([1, 2, 3, 4], 99, 3.97),
        ([10, 0, 5], 0, 0),
        ([10, 0, 5], 100, 10),
        ([7.5], 99, 7.5),
        (list(range(101)), 99, 99),
    ],
)
def test_percentile_interpolates_between_closest_ranks(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == pytest.approx(expected)


def test_no_values_have_no_percentile() -> None:
    assert percentile([], 50) is None
    assert percentiles([], (50, 99)) == [None, None]


def test_percentiles_agree_with_percentile_and_reject_out_of_range() -> None:
    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    assert percentiles(values, (50, 90, 99)) == [percentile(values, q) for q in (50, 90, 99)]
    with pytest.raises(ValueError, match=r"in \[0, 100\]"):
        percentile(values, 101)


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
        return [Sample("h_bucket", {"model": model, "le": le}, c)
                for le, c in zip(("0.001", "0.01", "+Inf"), counts, strict=True)]

    before = scrape([5, 8, 9]) + scrape([100, 100, 100], model="other")
    after = scrape([15, 28, 29]) + scrape([200, 200, 200], model="other")
    assert sorted(bucket_increase("h", before, after, {"model": "default"})) == [
        (0.001, 10.0), (0.01, 20.0), (math.inf, 20.0)]
