"""benchmarks/side_by_side.py: every figure of a benchmark's rows compared by its median on each side."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "side_by_side.py"
spec = importlib.util.spec_from_file_location("side_by_side", SCRIPT)
assert spec is not None and spec.loader is not None
side_by_side = importlib.util.module_from_spec(spec)
sys.modules["side_by_side"] = side_by_side
spec.loader.exec_module(side_by_side)


def test_leaves_are_the_numbers_of_nested_rows_and_only_those() -> None:
    row = {"workers": 16, "kvctl": {"route_p50_ms": 0.25, "ok": True, "note": "x", "lag": {"probes": 3}}}
    assert side_by_side.leaves(row) == {"workers": 16.0, "kvctl.route_p50_ms": 0.25, "kvctl.lag.probes": 3.0}


def test_each_figure_is_the_median_of_its_runs_with_the_ratio() -> None:
    before = [[{"p50": 1.0, "rss": 100.0}], [{"p50": 3.0, "rss": 100.0}], [{"p50": 2.0, "rss": 100.0}]]
    after = [[{"p50": 2.0, "rss": 90.0}], [{"p50": 2.2, "rss": 95.0}], [{"p50": 9.0, "rss": 0.0}]]
    (row,) = side_by_side.compare(before, after)
    assert row["p50"] == {"before": 2.0, "after": 2.2, "ratio": 1.1}
    assert row["rss"] == {"before": 100.0, "after": 90.0, "ratio": 0.9}


def test_a_figure_some_runs_lack_is_the_median_of_those_that_have_it() -> None:
    """scale_bench's routes during a fold exist only in a run whose window saw one: a KeyError lost the rest."""
    before = [[{"p50": 1.0, "fold_ms": 5.0}], [{"p50": 3.0}]]
    after = [[{"p50": 2.0}], [{"p50": 2.0, "fold_ms": 4.0}]]
    (row,) = side_by_side.compare(before, after)
    assert row["fold_ms"] == {"before": 5.0, "after": 4.0, "ratio": 0.8}
    assert row["p50"] == {"before": 2.0, "after": 2.0, "ratio": 1.0}
