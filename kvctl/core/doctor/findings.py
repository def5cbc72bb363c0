"""What every doctor check returns: a finding with its severity, cause, evidence and next step, the limits the
checks compare against, and the few helpers that name workers the same way in every finding."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from kvctl.core.names import format_worker
from kvctl.core.silence import SILENT_AFTER_S

SHOWN = 8
"""Workers named in one finding's evidence; the count says how many more there are."""


class Severity(IntEnum):
    """Nagios' statuses, valued as its exit codes; `worst` ranks them."""

    OK = 0
    WARNING = 1
    CRITICAL = 2
    UNKNOWN = 3


@dataclass(frozen=True)
class Finding:
    check: str  # stable id, for scripts: router, workers, silent, streams, block_size, hashing, busy, ...
    severity: Severity
    cause: str
    evidence: dict[str, Any] = field(default_factory=dict)
    next_step: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"check": self.check, "severity": self.severity.name, "cause": self.cause,
                "evidence": self.evidence, "next_step": self.next_step}


@dataclass(frozen=True)
class Limits:
    silent_after_s: float = SILENT_AFTER_S
    most_busy_share: float = 0.5  # WARNING when more than this share of a model's workers is busy
    kv_full_share: float = 0.9  # "extreme" load: KV usage of a worker's capacity, with no threshold set
    divergence_share: float = 0.01  # replicas may differ by this share of blocks (events in flight)
    nodes_per_block: float = 0.75  # nodes are compressed runs of blocks: near one per block, nothing is shared
    min_blocks_for_shape: int = 10_000  # below this, the node/block ratio says nothing
    near_cap: float = 0.9  # approximate mode: blocks as a share of --max-tree-size
    unreachable_after_s: float = 10.0  # a discovered publisher not connected by then is not reachable from here
    recent_loss_s: float = 600.0  # an input refused or lost this recently is a WARNING; older, it is evidence
    loop_blocked_share: float = 0.005  # the loop held past 10 ms this share of the last minute: a route in 200 waits
    loop_clear_share: float = 0.0025  # a held loop's WARNING clears under this: hysteresis, so that it does not flap
    loop_min_stalls: int = 3  # a minute over the share in fewer stalls is a one-off pause (a snapshot), not a held loop
    loop_alone_share: float = 0.02  # ...unless it alone held the loop this long: over a second without an answer


@dataclass(frozen=True)
class PeerDiff:
    """A peer router compared with this one: blocks each holds per worker, and those only one holds."""

    url: str
    against: str  # this router's URL
    blocks: int
    differing: int
    workers: list[dict[str, Any]]


_RANK = {Severity.OK: 0, Severity.UNKNOWN: 1, Severity.WARNING: 2, Severity.CRITICAL: 3}
"""A known problem outranks a check that could not run; UNKNOWN outranks OK."""


def worst(findings: Iterable[Finding]) -> Severity:
    return max((f.severity for f in findings), key=_RANK.__getitem__, default=Severity.OK)


def worst_first(findings: Iterable[Finding]) -> list[Finding]:
    """A report's order: the findings to act on first."""
    return sorted(findings, key=lambda f: -_RANK[f.severity])


def worker_name(row: Mapping[str, Any]) -> str:
    """A /v1/workers (or stream) row's worker, as every finding names it."""
    return format_worker((row["worker_id"], row["dp_rank"]))


def named(names: Sequence[str]) -> dict[str, Any]:
    return {"workers": list(names[:SHOWN]), "count": len(names)}


def first_id(names: Sequence[str]) -> str:
    return names[0].split(":")[0] if names else "W"


def stream_name(stream: Mapping[str, Any]) -> str:
    return worker_name(stream["worker"])
