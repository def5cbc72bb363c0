"""Recovering a worker's index over Dynamo's request plane, as Dynamo's own routers do (docs/contract.md): the ZMQ
event plane keeps no history, so a kvctl that finds a worker after it has stored blocks asks the worker for them.

Each kv-events publisher files an `EventSource` record naming its worker's `recovery_target`. When one is found,
the worker's live events are held, the worker is asked for a tree dump of its index (core/events/request_plane.py
has the wire), and the index is reset to that dump; then the held events newer than the dump's `last_event_id`
are applied, the older ones dropped as already in it. A gap in a worker's event ids is filled the same way, with
the events from the first one missing. The answer comes back on a connection the worker opens to kvctl's one
answers' listener (recovery_answers.py), bounded in bytes and time. A worker that cannot be recovered, whatever the
failure (unreachable, refused, timed out, cut short, too large, not a worker at all), is followed from its live
events on, marked partial with why, and counted in the health ledger by cause: none stays recovering.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kvctl.core.events.errors import DecodeError
from kvctl.core.events.publishers import Order
from kvctl.core.events.request_plane import (
    ACK_HEADER,
    Recovered,
    RecoveryRefused,
    RecoveryTarget,
    ack_length,
    decode_recovery_response,
    encode_recovery_request,
    parse_event_source,
)
from kvctl.core.events.types import RouterEvent
from kvctl.core.names import WorkerKey, format_worker
from kvctl.core.words import counted
from kvctl.server.health import Health
from kvctl.server.plane.recovery_answers import AnswerListener, RecoveryFailed, address

log = logging.getLogger("kvctl.serve")
Held = tuple[RouterEvent, Order, int]  # a live event, its order, its publisher id
Apply = Callable[[WorkerKey, Recovered, list[Held]], Awaitable[None]]

RECOVERY_TIMEOUT_S = 30.0
"""How long one query may take, the worker's connection back included (a large worker's dump is a few MiB)."""
MAX_QUERIES = 64
"""Queries out at once (a fleet found at start is asked in turns, each with its full timeout): bounds the
connections to workers and back."""
FAILURE_FIX = "make the worker's recovery_target (v1/event_sources) reachable from kvctl and kvctl's answers' " \
              "listener (--advertise-host, else --listen) from the worker; see the runbook's recovery section"


@dataclass
class _Worker:
    """One worker's recovery: its target, its state, and the live events held while a query is out."""

    target: RecoveryTarget
    state: str = "recovering"  # recovering, recovered, partial
    reason: str | None = None
    queries: int = 0
    events: int = 0
    last_event_id: int | None = None
    held: list[Held] = field(default_factory=list)
    task: asyncio.Task[None] | None = None

    def row(self) -> dict[str, Any]:
        return {"state": self.state, "reason": self.reason, "publisher_id": self.target.publisher_id,
                "target": self.target.address, "queries": self.queries, "events": self.events,
                "last_event_id": self.last_event_id}


class RecoveryClient:
    """Sends recovery queries; their answers come back to its listener (recovery_answers.py)."""

    def __init__(self, listener: AnswerListener, timeout_s: float = RECOVERY_TIMEOUT_S) -> None:
        self.listener = listener
        self.timeout_s = timeout_s
        self._turns = asyncio.Semaphore(MAX_QUERIES)

    async def start(self) -> None:
        """Listen for answers (once, before any query: concurrent queries share the one listener). When it cannot
        bind, the part `recovery` is down and an OSError raised; each query tries again."""
        if self.listener.started:
            return
        health = self.listener.health
        try:
            await self.listener.start()
        except OSError as exc:
            health.fail("recovery", f"cannot listen for workers' recovery answers on {self.listener.listen_host}: "
                        f"{exc.strerror or exc}", "give --advertise-host (or --listen) an address of this host")
            raise
        health.recover("recovery")

    async def close(self) -> None:
        await self.listener.close()

    async def query(self, target: RecoveryTarget, start_event_id: int | None = None) -> Recovered:
        """The worker's events from `start_event_id` (None: its whole index); raises OSError, TimeoutError,
        DecodeError, RecoveryRefused, RecoveryFailed or asyncio.IncompleteReadError."""
        async with self._turns:
            try:
                await self.start()
            except OSError as exc:
                raise RecoveryFailed("no_listener", f"kvctl cannot listen for answers: {exc}") from None
            subject, request_id = str(uuid.uuid4()), str(uuid.uuid4())
            answer = self.listener.expect(subject)
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self._ask(target, request_id, subject, start_event_id)
                    stream = await answer.done
            finally:
                answer.close()  # timed out, failed or answered: its connection goes now
            return decode_recovery_response(stream)

    async def _ask(self, target: RecoveryTarget, request_id: str, subject: str, start_event_id: int | None) -> None:
        """Send the query on a connection of its own; RecoveryRefused when the worker's acknowledgement does."""
        if self.listener.is_self(target.host, target.port):
            raise RecoveryFailed("self", "the recovery target is this router's own answers' listener")
        reader, writer = await asyncio.open_connection(target.host, target.port)
        try:
            here = writer.get_extra_info("sockname")[0]
            reply = address(self.listener.reply_host(here, target.host), self.listener.port)
            writer.write(encode_recovery_request(target, request_id, subject, reply, start_event_id))
            await writer.drain()
            refusal = await reader.readexactly(ack_length(await reader.readexactly(ACK_HEADER)))
        finally:
            writer.transport.abort()
        if refusal:
            raise RecoveryRefused(f"the worker refused the request: {refusal.decode(errors='replace')}")


def failure(exc: Exception, timeout_s: float) -> tuple[str, str]:
    """A failed query's cause (the ledger's label) and why, in words."""
    if isinstance(exc, RecoveryFailed):
        return exc.cause, str(exc)
    if isinstance(exc, TimeoutError):
        return "timeout", f"no whole answer within --recovery-timeout ({timeout_s:g} s)"
    if isinstance(exc, asyncio.IncompleteReadError):
        return "closed_early", (f"the target closed the connection after {len(exc.partial)} of the "
                                f"{exc.expected} bytes of its acknowledgement")
    if isinstance(exc, RecoveryRefused):
        return "refused", str(exc)
    if isinstance(exc, DecodeError):
        return "bad_answer", str(exc)
    if isinstance(exc, OSError):
        return "unreachable", exc.strerror or str(exc) or type(exc).__name__
    return "error", f"{type(exc).__name__}: {exc}"


class Recovery:
    """Which workers were recovered, which are being, which could not be; and the held live events."""

    def __init__(self, apply: Apply, counts: Counter[str], client: RecoveryClient, health: Health) -> None:
        """`counts`: the plane's (status and /metrics show them), counted under `recovery_*` names; each failed
        query is also a loss in `health` (surface `recovery`, by cause)."""
        self.client = client
        self.health = health
        self._failed: dict[WorkerKey, str] = {}  # each worker's last failure's cause: a repeat logs at DEBUG
        self._apply = apply
        self.workers: dict[WorkerKey, _Worker] = {}
        self.counts = counts
        self.record_errors: Counter[str] = Counter()
        self._seen: dict[str, bytes] = {}

    def follow(self, records: dict[str, bytes]) -> None:
        """The event-source records now in discovery: recover each worker whose kv-events source is new."""
        for key, value in records.items():
            if self._seen.get(key) == value:
                continue
            self._seen[key] = value
            try:
                target = parse_event_source(value)
            except DecodeError as exc:
                self.record_errors[exc.kind.value] += 1
                log.warning("recovery: event-source record %s skipped: %s", key, exc)
                continue
            if target is None:
                continue
            known = self.workers.get(target.worker)
            if known is not None and known.target == target:
                continue
            self._start(target, None)
        for key in [k for k in self._seen if k not in records]:
            del self._seen[key]

    def hold(self, event: RouterEvent, order: Order, publisher_id: int, last: int | None) -> bool:
        """Whether the live event is held for a recovery (one under way, or one its gap starts: `last` is the
        worker's last event id applied); held events are applied once the answer is."""
        worker = (event.worker_id, event.dp_rank)
        known = self.workers.get(worker)
        if known is None:
            return False
        if known.state != "recovering" and last is not None and event.event_id > last + 1:
            self.counts["recovery_gaps"] += 1
            self._start(known.target, last + 1)
        if self.workers[worker].state == "recovering":
            self.workers[worker].held.append((event, order, publisher_id))
            return True
        return False

    def forget(self, worker: WorkerKey) -> None:
        self._failed.pop(worker, None)
        known = self.workers.pop(worker, None)
        if known is not None and known.task is not None:
            known.task.cancel()

    async def close(self) -> None:
        for worker in list(self.workers):
            self.forget(worker)
        await self.client.close()

    def _start(self, target: RecoveryTarget, start_event_id: int | None) -> None:
        old = self.workers.get(target.worker)
        entry = _Worker(target, held=[] if old is None else old.held)  # a new target's too: the worker's events
        if old is not None and old.task is not None:
            old.task.cancel()
        self.workers[target.worker] = entry
        entry.task = asyncio.get_running_loop().create_task(self._recover(entry, start_event_id))

    async def _recover(self, entry: _Worker, start_event_id: int | None) -> None:
        """Ask, then apply the answer and the events held meanwhile. Whatever fails, the worker ends partial and
        its held events are applied: none is left recovering."""
        target = entry.target
        entry.queries += 1
        self.counts["recovery_queries"] += 1
        recovered = Recovered([], [], 0, reset=False)
        started = time.monotonic()
        try:
            if target.transport != "tcp":
                raise RecoveryFailed("unsupported_transport", f"its recovery target is on Dynamo's "
                                     f"{target.transport} request plane; kvctl speaks the tcp one only")
            recovered = await self.client.query(target, start_event_id)
        except Exception as exc:  # noqa: BLE001 - any failure leaves the worker partial, never recovering
            self._failure(entry, exc)
        else:
            entry.state, entry.events, entry.last_event_id = "recovered", len(recovered.events), recovered.last_event_id
            self._failed.pop(target.worker, None)
            self.counts["recovered_workers"] += 1
            self.counts["recovery_decode_errors"] += len(recovered.errors)
            log.info("recovery: worker %s: %s up to event id %d from %s in %.3f s", format_worker(target.worker),
                     counted(len(recovered.events), "event"), recovered.last_event_id, target.address,
                     time.monotonic() - started)
        held, entry.held = entry.held, []
        await self._apply(target.worker, recovered, held)

    def _failure(self, entry: _Worker, exc: Exception) -> None:
        """Mark the worker partial, count the loss, and log it (at DEBUG when it repeats the worker's last)."""
        target = entry.target
        cause, why = failure(exc, self.client.timeout_s)
        where = target.address if target.transport == "tcp" else target.transport
        entry.state, entry.reason = "partial", f"recovery from {where} failed: {why}"
        self.counts["recovery_failures"] += 1
        self.health.lose("recovery", cause, detail=f"worker {format_worker(target.worker)}: {entry.reason}",
                         fix=FAILURE_FIX)
        level = logging.DEBUG if self._failed.get(target.worker) == cause else logging.WARNING
        self._failed[target.worker] = cause
        log.log(level, "recovery: worker %s: %s; following its live events only", format_worker(target.worker),
                entry.reason, exc_info=exc if cause == "error" else None)

    def state(self, worker: WorkerKey) -> dict[str, Any] | None:
        known = self.workers.get(worker)
        return None if known is None else known.row()

    def status(self) -> dict[str, Any]:
        states = Counter(w.state for w in self.workers.values())
        listener = self.client.listener
        return {"workers": dict(states), "record_errors": dict(self.record_errors), "stray_streams": listener.stray,
                "timeout_s": self.client.timeout_s, "max_bytes": listener.max_bytes,
                "listener": None if listener.host is None else address(listener.host, listener.port)}
