"""In-flight requests per worker: the load half of the routing cost (docs/contract.md, Dynamo's ActiveSequences).

A worker's decode load is the number of distinct prompt blocks of its in-flight requests (shared
prompt blocks are refcounted, so ten requests on one system prompt cost its blocks once); its prefill
load is the prompt tokens it still has to compute, held until the request's prefill completes.
Unknown request ids are reported (False), never raised: frees arrive twice and late in real fleets.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from kvctl.core.names import WorkerKey

EXPIRY_S = 300.0
"""Requests older than this are force-freed (Dynamo's EXPIRY_DURATION): their free was lost."""


@dataclass(slots=True)
class ActiveRequest:
    request_id: str
    worker: WorkerKey
    block_hashes: tuple[int, ...]  # the prompt's sequence hashes
    prefill_tokens: int
    added_at: float
    prefill_done: bool = False
    overlap_blocks: int = 0  # the router's prediction when it chose the worker, to join with what the engine found


@dataclass(frozen=True, slots=True)
class Load:
    active_blocks: int = 0
    active_prefill_tokens: int = 0
    requests: int = 0


class LoadView(Protocol):
    """What the cost function reads of a worker's load."""

    @property
    def active_blocks(self) -> int: ...

    @property
    def active_prefill_tokens(self) -> int: ...

    @property
    def requests(self) -> int: ...


@dataclass(slots=True)
class _WorkerState:
    refcounts: dict[int, int] = field(default_factory=dict)
    active_prefill_tokens: int = 0
    requests: int = 0

    @property
    def active_blocks(self) -> int:
        return len(self.refcounts)


class ActiveSequences:
    def __init__(self, expiry_s: float = EXPIRY_S) -> None:
        if not expiry_s > 0:
            raise ValueError(f"expiry_s must be > 0, got {expiry_s}")
        self.expiry_s = expiry_s
        self._requests: dict[str, ActiveRequest] = {}
        self._workers: dict[WorkerKey, _WorkerState] = {}
        self.blocks = 0  # prompt blocks of the requests in flight, shared ones counted each time: what they hold

    def add(self, request_id: str, worker: WorkerKey, block_hashes: Sequence[int], prefill_tokens: int,
            now: float, overlap_blocks: int = 0) -> bool:
        """Track a routed request; False (and nothing changes) when the id is already in flight."""
        if request_id in self._requests:
            return False
        if prefill_tokens < 0:
            raise ValueError(f"prefill_tokens must be >= 0, got {prefill_tokens}")
        hashes = tuple(block_hashes)
        self._requests[request_id] = ActiveRequest(request_id, worker, hashes, prefill_tokens, now,
                                                     overlap_blocks=overlap_blocks)
        self.blocks += len(hashes)
        state = self._workers.get(worker)
        if state is None:
            state = self._workers[worker] = _WorkerState()
        refs = state.refcounts
        for h in hashes:
            refs[h] = refs.get(h, 0) + 1
        state.active_prefill_tokens += prefill_tokens
        state.requests += 1
        return True

    def mark_prefill_completed(self, request_id: str) -> bool:
        request = self._requests.get(request_id)
        if request is None:
            return False
        if not request.prefill_done:
            request.prefill_done = True
            self._workers[request.worker].active_prefill_tokens -= request.prefill_tokens
        return True

    def free(self, request_id: str) -> bool:
        """Release a request; idempotent (False when the id is not in flight)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        self.blocks -= len(request.block_hashes)
        state = self._workers[request.worker]
        refs = state.refcounts
        for h in request.block_hashes:
            n = refs[h] - 1
            if n:
                refs[h] = n
            else:
                del refs[h]
        if not request.prefill_done:
            state.active_prefill_tokens -= request.prefill_tokens
        state.requests -= 1
        if not state.requests:
            del self._workers[request.worker]
        return True

    def expire(self, now: float) -> list[str]:
        """Force-free every request added at or before `now - expiry_s`; returns their ids."""
        deadline = now - self.expiry_s
        stale = [rid for rid, r in self._requests.items() if r.added_at <= deadline]
        for rid in stale:
            self.free(rid)
        return stale

    def remove_worker(self, worker_id: int) -> list[str]:
        """Drop the requests of a worker that left (all its dp ranks)."""
        gone = [rid for rid, r in self._requests.items() if r.worker[0] == worker_id]
        for rid in gone:
            self.free(rid)
        return gone

    def load(self, worker: WorkerKey) -> Load:
        state = self._workers.get(worker)
        if state is None:
            return Load()
        return Load(len(state.refcounts), state.active_prefill_tokens, state.requests)

    def loads(self) -> Mapping[WorkerKey, LoadView]:
        """Live view of every worker with requests in flight (idle workers are absent)."""
        return MappingProxyType(self._workers)

    def new_prompt_blocks(self, worker: WorkerKey, block_hashes: Sequence[int]) -> int:
        """Blocks of a prompt that would add decode load on `worker`: all but the prefix it already runs."""
        state = self._workers.get(worker)
        if state is None:
            return len(block_hashes)
        refs = state.refcounts
        depth = 0
        for h in block_hashes:
            if h not in refs:
                break
            depth += 1
        return len(block_hashes) - depth

    def get(self, request_id: str) -> ActiveRequest | None:
        return self._requests.get(request_id)

    def requests(self, worker: WorkerKey | None = None) -> Iterable[ActiveRequest]:
        return [r for r in self._requests.values() if worker is None or r.worker == worker]

    def __len__(self) -> int:
        return len(self._requests)
