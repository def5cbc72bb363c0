"""Dynamo 1.6.1's router queue as a verdict (`--router-queue-threshold`, `--router-queue-policy`, or the policy
classes of `--router-policy-config`: policy_classes.py).

Dynamo's frontend holds a request in its router queue when every eligible rank of the pool has more prefill
tokens in flight than a threshold of the request's class (absolute tokens, or a fraction of max_num_batched_tokens;
the flags' one class: the fraction), and dispatches the queue by the class's policy (fcfs: arrival order; wspt:
shortest job first, by (1 + priority) / uncached tokens). kvctl answers every route at once:
given the same threshold, it says when the frontend would hold the request instead, and why, so that a pick made
while the fleet queues is never read as one Dynamo would act on at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from kvctl.core.names import WorkerKey
from kvctl.core.router.busy import BusyReason, WorkerLoad, prefill_reasons

if TYPE_CHECKING:
    from kvctl.core.router.policy_classes import PolicyClass


class QueuePolicy(StrEnum):
    fcfs = "fcfs"
    wspt = "wspt"


@dataclass(frozen=True, slots=True)
class RouterQueue:
    """The frontend's queue: `threshold` is a fraction (>= 0) of a rank's max_num_batched_tokens."""

    threshold: float
    policy: QueuePolicy = QueuePolicy.fcfs

    def __post_init__(self) -> None:
        if isinstance(self.threshold, bool) or not (math.isfinite(self.threshold) and self.threshold >= 0):
            raise ValueError(f"the router queue threshold must be a finite number >= 0, got {self.threshold!r}")


@dataclass(frozen=True, slots=True)
class WouldQueue:
    """Why a route would wait in the frontend's queue: the class it falls in, and every rank of its pool over one
    of the class's thresholds (absolute tokens, or a fraction of max_num_batched_tokens)."""

    policy_class: PolicyClass
    over: Mapping[WorkerKey, BusyReason]


def rank_over(policy_class: PolicyClass, load: WorkerLoad) -> BusyReason | None:
    """The threshold of the class a rank's prefill tokens in flight are strictly over, if any (either is enough)."""
    over = prefill_reasons(load, policy_class.prefill_busy_threshold, policy_class.prefill_busy_threshold_frac)
    return over[0] if over else None


def would_queue(policy_class: PolicyClass, loads: Mapping[WorkerKey, WorkerLoad]) -> WouldQueue | None:
    """The verdict over one pool's eligible ranks (their loads): None while the class holds nothing (no threshold)
    or some rank is at or under its thresholds."""
    if not policy_class.queues:
        return None
    over = {}
    for worker, load in loads.items():
        reason = rank_over(policy_class, load)
        if reason is None:
            return None
        over[worker] = reason
    return WouldQueue(policy_class, over) if over else None
