"""Session affinity (Dynamo 1.6.1's `--router-session-affinity-ttl-secs`): a session's requests go to the worker it
is pinned to, per worker set (a disaggregated fleet pins a session to a prefill worker and, apart, to a decode
one). Bindings come from the frontend's `session_affinity_events` and from this router's own booked routes; each
lives `ttl_s` after it was last heard of or used (Dynamo's idle TTL), and past `max_entries` the least recently
used goes first, counted. Pure: the caller passes the clock."""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum

from kvctl.core.names import Role, WorkerKey

MAX_ENTRIES = 65_536
"""Dynamo's bound on the sessions a router keeps."""
MAX_TTL_S = 31_536_000
"""Dynamo's bounds on the TTL: 1 s to a year."""


class SessionMode(StrEnum):
    """Dynamo's `--router-session-affinity-mode`: soft hands the binding to custom selection policies as a
    preference; its default selector, the cost function kvctl implements, pins in both."""

    hard = "hard"
    soft = "soft"


@dataclass(slots=True)
class _Binding:
    worker: WorkerKey
    sequence: int
    used_at: float


class SessionBook:
    def __init__(self, ttl_s: float, max_entries: int = MAX_ENTRIES) -> None:
        if isinstance(ttl_s, bool) or not (math.isfinite(ttl_s) and 1 <= ttl_s <= MAX_TTL_S):
            raise ValueError(f"the session affinity TTL must be 1 to {MAX_TTL_S} seconds, got {ttl_s!r}")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._bindings: OrderedDict[tuple[Role, str], _Binding] = OrderedDict()  # least recently used first
        self.evicted = 0  # sessions dropped for room, before their TTL

    def bind(self, pool: Role, session_id: str, worker: WorkerKey, now: float, sequence: int | None = None) -> None:
        """Pin a session in a pool. A frontend's binding with a lower `sequence` (its version) than the one held
        is late and changes nothing but the time; this router's own (no sequence) always wins."""
        key = (_worker_set(pool), session_id)
        held = self._bindings.get(key)
        if held is not None and sequence is not None and sequence < held.sequence:
            held.used_at = now
        else:
            self._bindings[key] = _Binding(worker, sequence if sequence is not None else
                                           (held.sequence if held is not None else 0), now)
        self._bindings.move_to_end(key)
        while len(self._bindings) > self.max_entries:
            self._bindings.popitem(last=False)
            self.evicted += 1

    def pinned(self, pool: Role, session_id: str, now: float) -> WorkerKey | None:
        """The worker the session is pinned to in the pool, unless its binding idled out; a use refreshes it."""
        key = (_worker_set(pool), session_id)
        held = self._bindings.get(key)
        if held is None:
            return None
        if now - held.used_at >= self.ttl_s:
            del self._bindings[key]
            return None
        held.used_at = now
        self._bindings.move_to_end(key)
        return held.worker

    def expire(self, now: float) -> int:
        """Drop every binding idle for the TTL; how many went."""
        gone = [key for key, held in self._bindings.items() if now - held.used_at >= self.ttl_s]
        for key in gone:
            del self._bindings[key]
        return len(gone)

    def __len__(self) -> int:
        return len(self._bindings)


def _worker_set(pool: Role) -> Role:
    """Bindings are per worker set, as the frontend's channels are: the prefill workers', and the model's own
    (aggregated, or a disaggregated fleet's decode workers: both register as the model's backend)."""
    return Role.prefill if pool is Role.prefill else Role.aggregated
