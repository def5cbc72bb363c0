"""What a Dynamo event plane delivers, whatever carries it: NATS subjects (nats_plane.py) or, later, the sockets
of Dynamo's ZMQ event plane. Both carry the same envelope and payloads (docs/contract.md), so one ingest decodes and
applies them, and one way of judging order serves both.

A transport hands over each message with where it came from (component, endpoint, topic); the ingest decodes
the envelope, judges order per publisher (core/events/publishers.py), then by topic: `kv-events` to the
model's writer, `kv_metrics` and `forward-pass-metrics` to the fleet's per-worker reports, and peers'
`active_sequences_events` to the fleet's in-flight requests. Event ids per (worker, dp_rank), judged by the
same rules, count lost events; ids going back with a restarted or new publisher clear that worker first.
Nothing is dropped for its event id alone (but a JetStream redelivery): one absurd id is a jump, counted,
and must not freeze a worker.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

from kvctl.core.events import Cleared, EventData, RouterEvent
from kvctl.core.events.dynamo import (
    decode_envelope,
    decode_router_event_batch,
    decode_router_event_items,
    split_router_event_batch,
)
from kvctl.core.events.errors import DecodeError
from kvctl.core.events.plane import (
    ACTIVE_SEQUENCES,
    FORWARD_PASS,
    KV_EVENTS,
    KV_METRICS,
    TOPICS,
    ActiveSequenceEvent,
    AddRequest,
    decode_active_load,
    decode_forward_pass,
    decode_sequence_events,
)
from kvctl.core.events.publishers import Numbering, Order, Publisher, PublisherBook
from kvctl.core.events.request_plane import Recovered
from kvctl.core.events.session_affinity import SESSION_AFFINITY, decode_session_binding
from kvctl.core.names import Role, WorkerKey, format_worker
from kvctl.core.router.sequences import ActiveRequest
from kvctl.server.budget import Slices
from kvctl.server.ingest.streams import SLICE_EVENTS, ModelWriter
from kvctl.server.plane.recovery import Recovery
from kvctl.server.plane.replica_sync import SURFACE, PeerBookings, PeerLimits, audit_heard
from kvctl.server.state import ADD, Fleet

log = logging.getLogger("kvctl.serve")

LARGE_BYTES = 64 * 1024
"""A `kv-events` payload larger than this (some 350 events) is decoded a slice of the loop at a time."""

Handler = Callable[[bytes, Order, Publisher, float], Awaitable[None]]


class _Reported(Protocol):
    @property
    def worker_id(self) -> int: ...

    @property
    def dp_rank(self) -> int: ...


R = TypeVar("R", bound=_Reported)
E = TypeVar("E")


class LossWatch(Protocol):
    """Told what the ingest learns of lost messages and events (the NATS plane's `NatsLosses`)."""

    def heard(self, publisher: Publisher, order: Order) -> None: ...

    def lost_events(self, worker: WorkerKey, n: int) -> None: ...

    def cleared(self, worker: WorkerKey) -> None: ...

    @property
    def gapped(self) -> Mapping[WorkerKey, int]:
        """KV events each worker lost since it was last cleared."""
        ...


class _Cursor:
    """Event ids of one (worker, dp_rank), judged by the one set of sequence rules, and the publisher that sent
    the last one."""

    __slots__ = ("ids", "publisher_id")

    def __init__(self, redelivered: bool) -> None:
        self.ids = Numbering(redelivered=redelivered)
        self.publisher_id: int | None = None


class PlaneIngest:
    def __init__(self, fleet: Fleet, writer: ModelWriter, *, model: str, router_id: int, replica_sync: bool,
                 kv_events: bool = True, peer_limits: PeerLimits | None = None, surface: str = "nats") -> None:
        """`kv_events=False`: KV events come another way (kvctl's JetStream stream); these are counted, not
        applied, as a second copy would apply twice. `peer_limits`: what replica sync takes from other routers.
        `surface`: the transport, as the health ledger names it."""
        self.fleet = fleet
        self.surface = surface
        self.writer = writer
        self.model = model
        self.router_id = router_id
        self.peers = PeerBookings(fleet, model, peer_limits or PeerLimits()) if replica_sync else None
        self.kv_events = kv_events
        self.counts: Counter[str] = Counter()  # messages, events, lost_events, restarts, load_reports, ...
        self.errors: Counter[str] = Counter()  # decode errors by kind
        self.topics: Counter[str] = Counter()  # messages received, by topic
        self.cursors: dict[WorkerKey, _Cursor] = {}
        self.publishers = PublisherBook()
        self.endpoints: dict[WorkerKey, tuple[str, str]] = {}  # (component, endpoint) each worker publishes under
        self._slices = Slices()
        self.recovery: Recovery | None = None  # the ZMQ plane's: holds a worker's live events while it is recovered
        self.watch: LossWatch | None = None  # the NATS plane's: what its drops cost, and which workers are gapped
        self._handlers: dict[str, Handler] = {KV_EVENTS: self._on_kv_events, KV_METRICS: self._on_load,
                                              ACTIVE_SEQUENCES: self._on_sequence, FORWARD_PASS: self._on_forward_pass,
                                              SESSION_AFFINITY: self._on_session}

    async def receive(self, component: str, endpoint: str, topic: str, body: bytes) -> None:
        """One message of a topic, as it came: the envelope, then the topic's payload inside it."""
        handler = self._handlers.get(topic)
        if handler is None:
            return
        self.topics[topic] += 1
        if topic == KV_EVENTS and self.kv_events:
            self.counts["messages"] += 1
        try:
            envelope = decode_envelope(body)
        except DecodeError as exc:
            self.errors[exc.kind.value] += 1
            return
        now = time.monotonic()
        book = self.publishers
        evicted = book.evicted
        order, publisher = book.observe(envelope.publisher_id, envelope.sequence, now, topic, component, endpoint)
        if book.evicted != evicted:
            self._forgot(publisher, now)
        if self.watch is not None:
            self.watch.heard(publisher, order)
        if order is Order.repeat:
            return
        if order is Order.restart:
            log.warning("event plane: publisher %d of %s on %s.%s started over (sequence %d)",
                        publisher.publisher_id, topic, component, endpoint, envelope.sequence)
        await handler(envelope.payload, order, publisher, now)

    def _forgot(self, newcomer: Publisher, now: float) -> None:
        """A publisher forgotten to make room for `newcomer`: its position is lost (a gap of its own would go
        unseen), and which workers it spoke for (a worker gone from discovery would be left in the index)."""
        gone = self.publishers.last_evicted
        assert gone is not None
        detail = (f"publisher {gone.publisher_id} ({gone.topic} of {gone.component}.{gone.endpoint}, heard "
                  f"{now - gone.last_seen:.1f} s ago) forgotten for publisher {newcomer.publisher_id}: "
                  f"over {self.publishers.limit:,} at once")
        if self.publishers.evicted == 1:
            log.warning("event plane: %s; further ones are counted in /v1/status health", detail)
        self.fleet.health.lose(self.surface, "too_many_publishers", detail=detail, fix=(
            "a fleet has one publisher per engine process and topic: find who sends new publisher ids "
            "(GET /v1/status event_plane.publishers), a crash-looping engine or a stray sender"))

    def _spoke_for(self, publisher: Publisher, worker: WorkerKey) -> None:
        publisher.workers.add(worker)
        self.endpoints[worker] = (publisher.component, publisher.endpoint)

    # ----- KV events ----------------------------------------------------------------------------------

    async def _on_kv_events(self, payload: bytes, order: Order, publisher: Publisher, now: float) -> None:
        if not self.kv_events:
            self.counts["core_kv_events_ignored"] += 1
            return
        slices = self._slices
        events = await self._large_batch(payload) if len(payload) > LARGE_BYTES else None
        for n, event in enumerate(self._batch(decode_router_event_batch, payload) if events is None else events):
            if not n % SLICE_EVENTS:
                await slices.tick()
            worker = (event.worker_id, event.dp_rank)
            self._spoke_for(publisher, worker)
            if self.recovery is not None and self.recovery.hold(event, order, publisher.publisher_id,
                                                                self._cursor(worker).ids.last):
                continue
            # Wait for room rather than drop: the transport's own buffer holds the backlog meanwhile.
            await self.writer.put_wait(worker, self._in_order(event, order, publisher.publisher_id))

    async def _large_batch(self, payload: bytes) -> list[RouterEvent] | None:
        """A large batch decoded `SLICE_EVENTS` at a time, the loop let run between (100,000 events took 1.2 s in
        one step), with what `_batch` would count; None when it is no array (`_batch` reads or refuses it whole)."""
        raws = split_router_event_batch(payload)
        if raws is None:
            return None
        events: list[RouterEvent] = []
        errors: list[DecodeError] = []
        try:
            for start in range(0, len(raws), SLICE_EVENTS):
                await self._slices.tick()
                got, bad = decode_router_event_items(raws[start:start + SLICE_EVENTS], start)
                events += got
                errors += bad
        except DecodeError as exc:  # an event that is no msgpack: the whole batch, as in one step
            self.errors[exc.kind.value] += 1
            return []
        for error in errors:
            self.errors[error.kind.value] += 1
        return events

    def _batch(self, decode: Callable[[bytes], tuple[list[E], list[DecodeError]]], payload: bytes,
               surface: str | None = None) -> list[E]:
        """The events of a batch that decode; each one that does not (or the whole batch) counted by kind, and in
        the health ledger under `surface` when given."""
        try:
            events, errors = decode(payload)
        except DecodeError as exc:
            errors = [exc]
            events = []
        for error in errors:
            self.errors[error.kind.value] += 1
            if surface is not None:
                self.fleet.health.lose(surface, "malformed", detail=str(error),
                                       fix="the publisher's encoding is not Dynamo 1.6.1's: find it in /v1/status "
                                           "event_plane.publishers")
        return events

    def _cursor(self, worker: WorkerKey, *, redelivered: bool = False) -> _Cursor:
        cursor = self.cursors.get(worker)
        if cursor is None:
            cursor = self.cursors[worker] = _Cursor(redelivered)
        return cursor

    def _restarted(self, worker: WorkerKey, event: RouterEvent, last: int | None) -> list[EventData]:
        self.counts["restarts"] += 1
        if self.watch is not None:
            self.watch.cleared(worker)
        log.warning("event plane: worker %s restarted (event id %d after %s): clearing it", format_worker(worker),
                    event.event_id, last)
        return [Cleared(), event.data]

    def _count(self, worker: WorkerKey, ids: Order, last: int | None, got: int) -> None:
        """What an event id tells beyond the envelope's order: events lost, or an absurd id."""
        if ids is Order.gap:
            assert last is not None
            self.counts["gaps"] += 1
            self.counts["lost_events"] += got - last - 1
            if self.watch is not None:
                self.watch.lost_events(worker, got - last - 1)
        elif ids is Order.jump:
            self.counts["event_id_jumps"] += 1

    def _in_order(self, event: RouterEvent, order: Order, publisher_id: int) -> list[EventData]:
        """What to apply for one event: its data, after a clear when its worker's publisher started over."""
        worker = (event.worker_id, event.dp_rank)
        cursor = self._cursor(worker)
        last, got = cursor.ids.last, event.event_id
        new_publisher = cursor.publisher_id not in (None, publisher_id)
        cursor.publisher_id = publisher_id
        ids = cursor.ids.observe(got)
        self.counts["events"] += 1
        if ids in (Order.restart, Order.repeat):
            if order is Order.restart or new_publisher:
                return self._restarted(worker, event, last)
            self.counts["event_id_regressions"] += 1  # applied all the same: order is the envelope's to judge
        self._count(worker, ids, last, got)
        return [event.data]

    async def apply_recovered(self, worker: WorkerKey, recovered: Recovered, held: list[tuple[RouterEvent, Order, int]]
                              ) -> None:
        """A worker's recovered events, then the live ones held meanwhile: a tree dump replaces the worker's
        index; events (a gap's) are applied past its last event id; held events the answer already holds (ids
        up to its `last_event_id`) are dropped."""
        cursor = self._cursor(worker)
        if recovered.reset:
            datas: list[EventData] = [Cleared(), *(e.data for e in recovered.events)]
        else:
            datas = [e.data for e in recovered.events if cursor.ids.last is None or e.event_id > cursor.ids.last]
        if recovered.reset or recovered.events:  # the position the answer leaves the worker at
            cursor.ids.last = (recovered.last_event_id if recovered.reset
                               else max(cursor.ids.last or 0, recovered.last_event_id))
        self.counts["recovered_events"] += len(datas) - recovered.reset
        await self.writer.put_wait(worker, datas)
        for event, order, publisher_id in held:
            same_publisher = cursor.publisher_id in (None, publisher_id)
            if cursor.ids.last is not None and event.event_id <= cursor.ids.last and same_publisher:
                self.counts["recovered_duplicates"] += 1
                continue
            await self.writer.put_wait(worker, self._in_order(event, order, publisher_id))

    def take_durable(self, event: RouterEvent) -> list[EventData]:
        """An event of kvctl's JetStream stream, sequenced by its id alone (the stream has no envelope): a
        redelivered copy of one already applied is dropped, ids starting over (1 or 0) a restarted publisher."""
        worker = (event.worker_id, event.dp_rank)
        cursor = self._cursor(worker, redelivered=True)
        last, got = cursor.ids.last, event.event_id
        ids = cursor.ids.observe(got)
        if ids is Order.repeat:
            self.counts["stale_events"] += 1
            return []
        self.counts["events"] += 1
        if ids is Order.restart:
            return self._restarted(worker, event, last)
        self._count(worker, ids, last, got)
        return [event.data]

    # ----- load reports, forward passes, replica sync -------------------------------------------------

    async def _on_load(self, payload: bytes, _order: Order, publisher: Publisher, now: float) -> None:
        load = self._report(payload, decode_active_load, "load_reports", publisher)
        if load is not None:
            self.fleet.report_load(load, now, self.model)

    async def _on_forward_pass(self, payload: bytes, _order: Order, publisher: Publisher, now: float) -> None:
        report = self._report(payload, decode_forward_pass, "forward_passes", publisher)
        if report is not None:
            self.fleet.report_forward_pass(report, now, self.model)

    async def _on_session(self, payload: bytes, _order: Order, publisher: Publisher, now: float) -> None:
        """A frontend's session binding, in the pool its channel's component names (`prefill`, or the model's own
        worker set); counted and dropped without session affinity on."""
        try:
            binding = decode_session_binding(payload)
        except DecodeError as exc:
            self.errors[exc.kind.value] += 1
            return
        self.counts["session_bindings"] += 1
        if self.fleet.sessions is not None:
            pool = Role.prefill if publisher.component == Role.prefill else Role.decode
            self.fleet.sessions.bind(pool, binding.session_id, binding.worker, now, binding.sequence)

    def _report(self, payload: bytes, decode: Callable[[bytes], R], counter: str, publisher: Publisher) -> R | None:
        """A worker's report of itself (its load, a forward pass): decoded, counted, and its worker known as the
        publisher's; None (counted by kind) when it does not decode."""
        try:
            report = decode(payload)
        except DecodeError as exc:
            self.errors[exc.kind.value] += 1
            return None
        self.counts[counter] += 1
        self._spoke_for(publisher, (report.worker_id, report.dp_rank))
        return report

    async def _on_sequence(self, payload: bytes, _order: Order, _publisher: Publisher, now: float) -> None:
        """Another router's decision is audited as heard, then, with replica sync, booked: judged under the loads
        it was routed under."""
        for event in self._batch(decode_sequence_events, payload, SURFACE):
            if event.router_id == self.router_id:
                self.counts["own_sequence_events"] += 1
                continue
            self.counts["peer_sequence_events"] += 1
            audit_heard(self.fleet, event, self.model, self.stale, now)
            if self.peers is not None:
                self.counts[self.peers.take(event, now)] += 1

    def stale(self) -> dict[WorkerKey, str]:
        """Workers whose blocks the index may not all hold yet, and why: being recovered, or events lost."""
        out = {}
        if self.recovery is not None:
            out.update({w: f"recovery {r.state}" for w, r in self.recovery.workers.items() if r.state != "recovered"})
        if self.watch is not None:
            out.update(dict.fromkeys(self.watch.gapped, "KV events lost"))
        return out

    def sequence_event(self, model: str, action: str, request: ActiveRequest | None,
                       route: Mapping[str, Any]) -> tuple[tuple[str, str] | None, ActiveSequenceEvent] | None:
        """This router's add / prefill complete / free as the event to publish, and the (component, endpoint)
        of the worker it concerns (where Dynamo's routers of that worker listen; None when the worker was never
        heard of on the plane); None when there is nothing to publish. Each plane frames it its own way."""
        if request is None or (model != self.model and request.worker not in self.endpoints):
            return None  # a model the plane's workers do not serve (the plane's own, or one their cards name)
        data = AddRequest(list(request.block_hashes), True, None, request.prefill_tokens) if action == ADD else action
        event = ActiveSequenceEvent(request.request_id, request.worker[0], request.worker[1], data, self.router_id,
                                    route.get("lora_name"))
        self.counts["published_sequence_events"] += 1
        return self.endpoints.get(request.worker), event

    # ----- views --------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "topics": {topic: self.topics[topic] for topic in TOPICS},
            "counts": dict(self.counts), "decode_errors": dict(self.errors),
            "sequence": self.publishers.totals(),
            "publishers": self.publishers.rows(now),
            "workers": self.sources(),
            "peers": None if self.peers is None else self.peers.status(),  # replica sync: what peers booked
        }

    def sources(self, addresses: Mapping[int, str] | None = None) -> list[dict[str, Any]]:
        """Where each worker's KV events come from: its publisher (with `addresses`, the ZMQ plane's, the address
        that publisher advertises), its last event id, and after a late join its recovery."""
        return [{"worker_id": w[0], "dp_rank": w[1], "publisher_id": c.publisher_id, "last_event_id": c.ids.last,
                 **({} if addresses is None else {"address": addresses.get(c.publisher_id or 0)}),
                 **({} if self.recovery is None else {"recovery": self.recovery.state(w)})}
                for w, c in sorted(self.cursors.items())]
