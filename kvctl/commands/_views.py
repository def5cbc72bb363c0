"""Table pieces shared by the commands that show workers (workers, route --explain, router status), so a
worker, an age and a counter map read the same in every table."""

from __future__ import annotations

from collections.abc import Mapping

from kvctl.output import Column

WORKER_COLUMNS = (Column("worker", "worker_id", justify="right"), Column("dp", "dp_rank", justify="right"))
"""The first two columns of every per-(worker, dp_rank) table."""

NAME_KEY = "name"
"""Rows of those tables carry `name` = "ID:DP": what `-o name` prints, and what `--worker` takes back."""


def counts(by_kind: Mapping[str, int] | None) -> str | None:
    """A counter map as `kind=n, …` (only non-zero kinds); None (shown `-`) when nothing was counted."""
    shown = [f"{kind}={n}" for kind, n in sorted((by_kind or {}).items()) if n]
    return ", ".join(shown) or None


def number(value: float | None) -> str | None:
    """A float with at most two decimals and never an exponent (costs and rates reach the thousands)."""
    if value is None:
        return None
    return f"{value:.2f}".rstrip("0").rstrip(".")
