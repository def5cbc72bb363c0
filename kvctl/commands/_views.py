"""Table pieces shared by the commands that show workers (workers, route --explain, router status), so a
worker, an age and a counter map read the same in every table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

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


def total(by_kind: Mapping[str, int] | None) -> int | None:
    """A counter map's sum; None (shown `-`) where there is no map (no engine stream follows the worker)."""
    return None if by_kind is None else sum(by_kind.values())


def kv_groups(groups: Sequence[Mapping[str, Any]] | None, dp_rank: int) -> str | None:
    """A worker's KV cache groups at a glance, `0:full_attention 1:sliding_window(128)`: a run of groups of one
    kind as `1-6:mamba`, one no store has named yet as `unnamed`, one of another DP rank than the row's (a stream
    whose batches name several) as `dp1/0:…`; None (shown `-`) where the stream named none (SGLang's do not)."""
    runs: list[tuple[str, int, int, str]] = []  # DP rank shown, first and last index, kind
    for group in sorted(groups or (), key=lambda g: (g["dp_rank"], g["group_idx"])):
        rank, idx, kind = _rank(group, dp_rank), group["group_idx"], group["kind"] or "unnamed"
        if group["sliding_window"] is not None:
            kind = f"{kind}({group['sliding_window']})"
        if runs and runs[-1][0] == rank and runs[-1][3] == kind and runs[-1][2] == idx - 1:
            runs[-1] = (rank, runs[-1][1], idx, kind)
        else:
            runs.append((rank, idx, idx, kind))
    return " ".join(f"{rank}{first}:{kind}" if first == last else f"{rank}{first}-{last}:{kind}"
                    for rank, first, last, kind in runs) or None


def group_detail(groups: Sequence[Mapping[str, Any]] | None, dp_rank: int) -> str | None:
    """Each group's block size and events kept (indexed) and dropped, `0:block_size=16,kept=3,dropped=0 …`."""
    shown = []
    for group in sorted(groups or (), key=lambda g: (g["dp_rank"], g["group_idx"])):
        size = "" if group["block_size"] is None else f"block_size={group['block_size']},"
        shown.append(f"{_rank(group, dp_rank)}{group['group_idx']}:{size}"
                     f"kept={group['events_kept']},dropped={group['events_dropped']}")
    return " ".join(shown) or None


def _rank(group: Mapping[str, Any], dp_rank: int) -> str:
    """`dpN/` before a group of another DP rank than its row's; nothing before the row's own."""
    return "" if group["dp_rank"] == dp_rank else f"dp{group['dp_rank']}/"


def salts(seen: int | None) -> str | None:
    """Distinct cache salts a stream saw (the router keeps no salt, only their count, which stops at a cap)."""
    from kvctl.core.events.normalizer import MAX_SALTS

    return None if seen is None else f"{seen}+" if seen >= MAX_SALTS else str(seen)


def stream_cells(seen: Mapping[str, Any] | None, dp_rank: int) -> dict[str, Any]:
    """The cells of what a worker's engine stream showed (`groups`, `salts_seen`, `events_dropped` of its
    `/v1/workers` row): compact ones for the table, full ones for `-o wide`; all None without a stream."""
    seen = seen or {}
    return {"kv_groups": kv_groups(seen.get("groups"), dp_rank),
            "group_detail": group_detail(seen.get("groups"), dp_rank),
            "salts": salts(seen.get("salts_seen")), "dropped": total(seen.get("events_dropped")),
            "dropped_by_cause": counts(seen.get("events_dropped"))}


STREAM_COLUMNS = (Column("groups", "kv_groups"), Column("dropped", "dropped", justify="right"))
"""What a worker's engine stream showed, at a glance: its KV cache groups and the events it did not index."""
STREAM_WIDE_COLUMNS = (Column("group detail", "group_detail", wide_only=True),
                       Column("salts", "salts", wide_only=True, justify="right"),
                       Column("dropped by cause", "dropped_by_cause", wide_only=True))
"""The same in full (`-o wide`): each group's block size and events kept and dropped, salts, drops by cause."""
