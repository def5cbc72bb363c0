"""Dynamo 1.6.1's router queue as a verdict (`--router-queue-threshold`, `--router-queue-policy`).

Dynamo's frontend holds a request in its router queue when every eligible rank of the pool has more prefill
tokens in flight than the threshold times its max_num_batched_tokens, and dispatches the queue by its policy
(fcfs: arrival order; wspt: shortest job first, by (1 + priority) / tokens). kvctl answers every route at once:
given the same threshold, it says when the frontend would hold the request instead, and why, so that a pick made
while the fleet queues is never read as one Dynamo would act on at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from kvctl.core.names import WorkerKey
from kvctl.core.router.busy import BusyReason, BusySignal, WorkerLoad, prefill_limit


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
    """Why a route would wait in the frontend's queue: every rank's prefill tokens over its limit."""

    queue: RouterQueue
    over: Mapping[WorkerKey, BusyReason]


def would_queue(queue: RouterQueue, loads: Mapping[WorkerKey, WorkerLoad]) -> WouldQueue | None:
    """The verdict over one pool's ranks (their loads): None while some rank is at or under its limit."""
    over = {}
    for worker, load in loads.items():
        limit = prefill_limit(queue.threshold, load)
        if load.active_prefill_tokens <= limit:
            return None
        over[worker] = BusyReason(BusySignal.active_prefill_tokens_frac, load.active_prefill_tokens, limit)
    return WouldQueue(queue, over) if over else None
