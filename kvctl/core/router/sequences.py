"""In-flight requests per worker: the load half of the routing cost (docs/contract.md, Dynamo's ActiveSequences).

A worker's decode load is the number of distinct prompt blocks of its in-flight requests (shared
prompt blocks are refcounted, so ten requests on one system prompt cost its blocks once); its prefill
load is the prompt tokens it still has to compute, held until the request's prefill completes.
Unknown request ids are reported (False), never raised: frees arrive twice and late in real fleets.

Requests other routers booked (replica sync) are held apart, keyed by (their router id, their request id), and
counted apart (`peer_requests`, `peer_blocks`): they add to a worker's load like this router's own, but a peer's
free reaches only its own booking, and this router's caps count only what it booked itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
    owner: int | None = None  # the peer router that booked it (replica sync); None: this router


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
        self._requests: dict[str, ActiveRequest] = {}  # this router's own
        self._peers: dict[tuple[int, str], ActiveRequest] = {}  # other routers', by (router id, request id)
        self._peer_owners: dict[str, tuple[int, ...]] = {}  # request id -> the peers that booked it (one, as a rule)
        self._workers: dict[WorkerKey, _WorkerState] = {}
        self.blocks = 0  # prompt blocks of this router's requests in flight, shared ones counted each time
        self.peer_blocks = 0  # the same of the peers' requests

    def add(self, request_id: str, worker: WorkerKey, block_hashes: Sequence[int], prefill_tokens: int,
            now: float, overlap_blocks: int = 0, owner: int | None = None) -> bool:
        """Track a routed request (`owner`: the peer router that booked it); False (and nothing changes) when the
        owner has that id in flight already."""
        if self.get(request_id, owner) is not None:
            return False
        if prefill_tokens < 0:
            raise ValueError(f"prefill_tokens must be >= 0, got {prefill_tokens}")
        hashes = tuple(block_hashes)
        request = ActiveRequest(request_id, worker, hashes, prefill_tokens, now, overlap_blocks=overlap_blocks,
                                owner=owner)
        if owner is None:
            self._requests[request_id] = request
            self.blocks += len(hashes)
        else:
            self._peers[(owner, request_id)] = request
            self._peer_owners[request_id] = (*self._peer_owners.get(request_id, ()), owner)
            self.peer_blocks += len(hashes)
        state = self._workers.get(worker)
        if state is None:
            state = self._workers[worker] = _WorkerState()
        refs = state.refcounts
        for h in hashes:
            refs[h] = refs.get(h, 0) + 1
        state.active_prefill_tokens += prefill_tokens
        state.requests += 1
        return True

    def mark_prefill_completed(self, request_id: str, owner: int | None = None) -> bool:
        request = self.get(request_id, owner)
        if request is None:
            return False
        if not request.prefill_done:
            request.prefill_done = True
            self._workers[request.worker].active_prefill_tokens -= request.prefill_tokens
        return True

    def free(self, request_id: str, owner: int | None = None) -> bool:
        """Release a request; idempotent (False when the owner has no such id in flight)."""
        if owner is None:
            request = self._requests.pop(request_id, None)
            if request is None:
                return False
            self.blocks -= len(request.block_hashes)
        else:
            request = self._peers.pop((owner, request_id), None)
            if request is None:
                return False
            self.peer_blocks -= len(request.block_hashes)
            if owners := tuple(o for o in self._peer_owners.pop(request_id) if o != owner):
                self._peer_owners[request_id] = owners
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
        """Force-free every request (own or a peer's) added at or before `now - expiry_s`; returns their ids."""
        deadline = now - self.expiry_s
        return self._free_all([r for r in self.requests() if r.added_at <= deadline])

    def remove_worker(self, worker_id: int) -> list[str]:
        """Drop the requests of a worker that left (all its dp ranks)."""
        return self._free_all([r for r in self.requests() if r.worker[0] == worker_id])

    def _free_all(self, requests: list[ActiveRequest]) -> list[str]:
        for r in requests:
            self.free(r.request_id, r.owner)
        return [r.request_id for r in requests]

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

    def get(self, request_id: str, owner: int | None = None) -> ActiveRequest | None:
        return self._requests.get(request_id) if owner is None else self._peers.get((owner, request_id))

    def peer_owners(self, request_id: str) -> tuple[int, ...]:
        """The peers that have a request of this id in flight."""
        return self._peer_owners.get(request_id, ())

    def requests(self, worker: WorkerKey | None = None) -> list[ActiveRequest]:
        """Every request in flight (this router's and its peers'), or those of one worker."""
        return [r for table in (self._requests, self._peers) for r in table.values()
                if worker is None or r.worker == worker]

    @property
    def peer_requests(self) -> int:
        """Peers' requests in flight."""
        return len(self._peers)

    def __len__(self) -> int:
        """This router's own requests in flight (what its --max-reservations caps)."""
        return len(self._requests)
