"""Percentiles as numpy's default (linear) method computes them; the expected values are numpy's."""

from __future__ import annotations

import pytest

from kvctl.core.quantiles import percentile, percentiles


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
