"""The checks `kvctl doctor` runs: each turns what a router reports into findings an on-call engineer
can act on, naming the cause, the numbers that show it, and the command to run next.

Pure: the inputs are the router's own API objects (`/v1/status`, `/v1/workers`, `/busy_threshold`)
and, for replica divergence, per-peer tree diffs; the command gathers them. A check that finds
nothing wrong says so with an OK finding, so the report always shows what was looked at.
"""
from kvctl.core.doctor.checks import (
    check_block_size,
    check_busy,
    check_divergence,
    check_hashing,
    check_hit_rates,
    check_index,
    check_loop,
    check_partial,
    check_recovery,
    check_registration,
    check_restoring,
    diagnose,
    differing_workers,
    odd_hashers,
)
from kvctl.core.doctor.events import check_event_plane, check_silent, check_streams
from kvctl.core.doctor.findings import SHOWN, Finding, Limits, PeerDiff, Severity, worst, worst_first

__all__ = [
    "SHOWN",
    "Finding",
    "Limits",
    "PeerDiff",
    "Severity",
    "check_block_size",
    "check_busy",
    "check_divergence",
    "check_event_plane",
    "check_hashing",
    "check_hit_rates",
    "check_index",
    "check_loop",
    "check_partial",
    "check_recovery",
    "check_registration",
    "check_restoring",
    "check_silent",
    "check_streams",
    "diagnose",
    "differing_workers",
    "odd_hashers",
    "worst",
    "worst_first",
]
