"""Recovering a worker's index over Dynamo's request plane, as Dynamo's own routers do (docs/contract.md): the ZMQ
event plane keeps no history, so a kvctl that finds a worker after it has stored blocks asks the worker for them.

Each kv-events publisher files an `EventSource` record naming its worker's `recovery_target`. When one is found,
the worker's live events are held, the worker is asked for a tree dump of its index (core/events/request_plane.py
has the wire), and the index is reset to that dump; then the held events newer than the dump's `last_event_id`
are applied, the older ones dropped as already in it. A gap in a worker's event ids is filled the same way, with
the events from the first one missing. The answer comes back on a connection the worker opens to kvctl: one
listener, on every IPv4 interface, advertised at the address kvctl reached the worker from. A worker that cannot be
recovered (unreachable, refused, timed out) is followed from its live events on, and marked partial with why.
"""

from __future__ import annotations

import asyncio
import contextlib
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
    FRAME_MAX,
    HANDSHAKE_MAX,
    Recovered,
    RecoveryRefused,
    RecoveryTarget,
    ResponseStream,
    TwoPartReader,
    ack_length,
    decode_recovery_response,
    encode_recovery_request,
    handshake_subject,
    parse_event_source,
)
from kvctl.core.events.types import RouterEvent
from kvctl.core.names import WorkerKey, format_worker
from kvctl.core.words import counted

log = logging.getLogger("kvctl.serve")
Held = tuple[RouterEvent, Order, int]  # a live event, its order, its publisher id
Apply = Callable[[WorkerKey, Recovered, list[Held]], Awaitable[None]]

RECOVERY_TIMEOUT_S = 30.0
"""How long one query may take, the worker's connection back included (a large worker's dump is a few MiB)."""
_READ = 1 << 16


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
    """Sends recovery queries and takes the answers workers stream back to its listener."""

    def __init__(self, timeout_s: float = RECOVERY_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._server: asyncio.Server | None = None
        self.port = 0
        self._pending: dict[str, tuple[ResponseStream, asyncio.Future[ResponseStream]]] = {}
        self.stray_streams = 0  # connections that named no query of ours

    async def start(self) -> None:
        """Listen for answers (once, before any query: concurrent queries share the one listener)."""
        self._server = await asyncio.start_server(self._on_stream, "0.0.0.0", 0)  # IPv4: Dynamo advertises IPv4
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def query(self, target: RecoveryTarget, start_event_id: int | None = None) -> Recovered:
        """The worker's events from `start_event_id` (None: its whole index); raises OSError, TimeoutError,
        DecodeError or RecoveryRefused."""
        if self._server is None:
            raise OSError("the answers' listener is not started")
        subject, request_id = str(uuid.uuid4()), str(uuid.uuid4())
        stream = ResponseStream()
        answered: asyncio.Future[ResponseStream] = asyncio.get_running_loop().create_future()
        self._pending[subject] = (stream, answered)
        try:
            async with asyncio.timeout(self.timeout_s):
                reader, writer = await asyncio.open_connection(target.host, target.port)
                try:
                    here = writer.get_extra_info("sockname")[0]  # where the worker reached us from: it can reach it
                    writer.write(encode_recovery_request(target, request_id, subject, f"{here}:{self.port}",
                                                         start_event_id))
                    await writer.drain()
                    refusal = await reader.readexactly(ack_length(await reader.readexactly(ACK_HEADER)))
                finally:
                    writer.close()
                    with contextlib.suppress(OSError):
                        await writer.wait_closed()
                if refusal:
                    raise RecoveryRefused(f"the worker refused the request: {refusal.decode(errors='replace')}")
                await answered
        finally:
            self._pending.pop(subject, None)
        return decode_recovery_response(stream)

    async def _on_stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frames = TwoPartReader(HANDSHAKE_MAX)
        waiting: tuple[ResponseStream, asyncio.Future[ResponseStream]] | None = None
        try:
            while waiting is None or not waiting[0].done:
                chunk = await reader.read(_READ)
                if not chunk:
                    break
                frames.push(chunk)
                while (message := frames.take()) is not None:
                    control, data = message
                    if waiting is None:
                        waiting = self._pending.get(handshake_subject(control))
                        if waiting is None:
                            self.stray_streams += 1
                            return
                        frames.limit = FRAME_MAX
                    else:
                        waiting[0].take(control, data)
        except (DecodeError, OSError) as exc:
            if waiting is None:
                self.stray_streams += 1
            elif not waiting[1].done():
                waiting[1].set_exception(exc)
        finally:
            if waiting is not None and not waiting[1].done():
                waiting[1].set_result(waiting[0])
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


class Recovery:
    """Which workers were recovered, which are being, which could not be; and the held live events."""

    def __init__(self, apply: Apply, counts: Counter[str], client: RecoveryClient) -> None:
        """`counts`: the plane's (status and /metrics show them), counted under `recovery_*` names."""
        self.client = client
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
        target = entry.target
        entry.queries += 1
        self.counts["recovery_queries"] += 1
        recovered = Recovered([], [], 0, reset=False)
        started = time.monotonic()
        try:
            if target.transport != "tcp":
                raise RecoveryRefused(f"its recovery target is on Dynamo's {target.transport} request plane; "
                                      "kvctl speaks the tcp one only")
            recovered = await self.client.query(target, start_event_id)
        except (OSError, TimeoutError, DecodeError, RecoveryRefused) as exc:
            why = "timed out" if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__
            where = target.address if target.transport == "tcp" else target.transport
            entry.state, entry.reason = "partial", f"recovery from {where} failed: {why}"
            self.counts["recovery_failures"] += 1
            log.warning("recovery: worker %s: %s; following its live events only", format_worker(target.worker),
                        entry.reason)
        else:
            entry.state, entry.events, entry.last_event_id = "recovered", len(recovered.events), recovered.last_event_id
            self.counts["recovered_workers"] += 1
            self.counts["recovery_decode_errors"] += len(recovered.errors)
            log.info("recovery: worker %s: %s up to event id %d from %s in %.3f s", format_worker(target.worker),
                     counted(len(recovered.events), "event"), recovered.last_event_id, target.address,
                     time.monotonic() - started)
        held, entry.held = entry.held, []
        await self._apply(target.worker, recovered, held)

    def state(self, worker: WorkerKey) -> dict[str, Any] | None:
        known = self.workers.get(worker)
        return None if known is None else known.row()

    def status(self) -> dict[str, Any]:
        states = Counter(w.state for w in self.workers.values())
        return {"workers": dict(states), "record_errors": dict(self.record_errors),
                "stray_streams": self.client.stray_streams, "timeout_s": self.client.timeout_s}
