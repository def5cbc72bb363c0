"""`kvctl serve --nats`: following a Dynamo fleet's NATS event plane (docs/contract.md).

One subscription to the whole namespace (`namespace.{ns}.>`), dispatched by subject: Dynamo 1.6.1 publishes
`namespace.{ns}.component.{comp}.endpoint.{ep}.{topic}`, every topic in the same envelope, and
`--component` / `--endpoint` narrow what is followed (default: every one). Subjects outside that shape or
scope are only counted, so `doctor` can name what the namespace carries when nothing we follow arrives.
What is in scope goes to the transport-free ingest (plane/ingest.py): KV events, load reports, forward
passes and, with `--replica-sync`, peers' in-flight requests; this router's own are published under the
endpoint of the worker they concern. With `--jetstream`, KV events come instead from kvctl's own stream as
RouterEvent JSON, acked once applied.

JetStream durability: on start the object-store snapshot is loaded (read until two reads agree) and
this router's durable consumer is recreated to deliver the whole stream after it, so snapshot + stream
always rebuild everything; when the stream outgrows `--snapshot-threshold`, the index is uploaded as
the snapshot (kvctl's documented serialisation: RouterEvent JSON lines) and the stream purged below the
lowest ack floor of all consumers. Durable consumers idle for 5 minutes (routers that are gone) are
removed by the server (`inactive_threshold`). A `--shadow` router reads with an ephemeral consumer,
never purges, uploads or publishes: it cannot change the fleet it watches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from kvctl.core.events import RouterEvent
from kvctl.core.events.dynamo import EnvelopeWriter, decode_router_event_json, encode_router_event_json
from kvctl.core.events.errors import DecodeError
from kvctl.core.events.plane import (
    ACTIVE_SEQUENCES,
    KV_EVENTS,
    RADIX_STATE_OBJECT,
    TOPICS,
    PlaneScope,
    encode_sequence_event,
)
from kvctl.core.index.kv_index import events_of
from kvctl.core.names import DEFAULT_MODEL
from kvctl.core.router.sequences import ActiveRequest
from kvctl.core.words import counted
from kvctl.errors import Unreachable
from kvctl.nats.barrier import barrier
from kvctl.nats.connection import PENDING_BYTES, PENDING_MSGS, NatsConnection, Reconnect, connect, server_id
from kvctl.nats.jetstream import ensure_stream, radix_state
from kvctl.server.budget import Slices
from kvctl.server.ingest.streams import ModelWriter, Streams
from kvctl.server.logs import error_text
from kvctl.server.plane.card_watch import CardWatch
from kvctl.server.plane.dynamo_discovery import open_discovery
from kvctl.server.plane.ingest import PlaneIngest
from kvctl.server.plane.model_cards import CardBlockSizes
from kvctl.server.plane.nats_losses import NatsLosses
from kvctl.server.plane.replica_sync import PeerLimits
from kvctl.server.plane.tasks import STOP_TIMEOUT_S, PlaneTasks
from kvctl.server.state import Fleet

log = logging.getLogger("kvctl.serve")

CONSUMER_INACTIVE_S = 300.0  # Dynamo's inactive_threshold: consumers of routers that are gone go away
FETCH_BATCH = 512
SNAPSHOT_CHECK_S = 1.0
SNAPSHOT_READS = 10
LOGGED_ERRORS_MAX = 16  # distinct connection errors logged between good connections (status shows them all)
SUBJECTS_SEEN_MAX = 256  # distinct subjects counted; the rest are summed under "(others)"


@dataclass(frozen=True, slots=True, kw_only=True)
class NatsOptions:
    """`kvctl serve --nats`'s plane. Keyword-only, as `ServeOptions`: ten fields, several strings and flags in a
    row, must not be passed by position."""

    connection: NatsConnection
    namespace: str = "dynamo"
    component: str | None = None  # None: every component of the namespace
    endpoint: str | None = None  # None: every endpoint
    model: str = DEFAULT_MODEL
    router_id: int = 0
    shadow: bool = False
    jetstream: bool = False
    snapshot_threshold: int = 1_000_000
    reset_states: bool = False
    replica_sync: bool = False
    peer_limits: PeerLimits = PeerLimits()  # what replica sync takes from other routers
    pending_msgs: int = PENDING_MSGS  # the subscription's, past which nats-py drops (counted as lost)
    pending_bytes: int = PENDING_BYTES
    cards: str | None = None  # the discovery store the workers' model cards are read from (--dynamo-discovery)
    block_sizes: CardBlockSizes = CardBlockSizes()  # which models take their cards' block size

    @property
    def url(self) -> str:
        """For logs, status and metrics: credentials written into the URL are masked (connect with
        `connection.url`)."""
        return self.connection.shown_url


BACKOFF = Reconnect(first_s=0.1, max_s=10.0)
"""The router waits for NATS for ever, at first and after losing it: 0.1 s doubling up to 10 s per failed try."""


class EventPlane(PlaneTasks):
    def __init__(self, fleet: Fleet, streams: Streams, options: NatsOptions) -> None:
        super().__init__("connecting")
        self.fleet = fleet
        self.options = options
        self.scope = PlaneScope(options.namespace, options.component, options.endpoint)
        self.names = self.scope.names()  # kvctl's JetStream stream and bucket (per component)
        self.writer: ModelWriter = streams.writer(options.model)
        self.nc: nats.NATS | None = None
        self.connects = 0
        self.reconnects = 0
        self._logged_errors: set[str] = set()  # said in the log since the last good connection
        self._slices = Slices()  # the subscription's backlog is handed over without a wait
        # KV events on the plane feed the index unless they come from the stream, or the router indexes its own
        # routes (approximate mode, Dynamo's --no-router-kv-events): then they are counted, not applied.
        kv_events = not options.jetstream and fleet.approx is None
        self.ingest = PlaneIngest(fleet, self.writer, model=options.model, router_id=options.router_id,
                                  replica_sync=options.replica_sync, kv_events=kv_events,
                                  peer_limits=options.peer_limits)
        self.counts = self.ingest.counts  # the plane's counters, connection's and ingest's alike
        self.errors = self.ingest.errors
        self.cursors = self.ingest.cursors
        self.losses = NatsLosses(fleet.health, self.ingest.publishers, self.scope, url=options.url,
                                 pending_msgs=options.pending_msgs, pending_bytes=options.pending_bytes,
                                 kv_events=kv_events)
        self.ingest.watch = self.losses
        fleet.clear_listeners.append(self.losses.cleared)
        self.sub: Subscription | None = None  # the namespace's, once subscribed
        self._closing = False
        self._sequence_writer = EnvelopeWriter(options.router_id, ACTIVE_SEQUENCES)
        self.subjects_seen: Counter[str] = Counter()
        self.ready_at: float | None = None
        self.snapshot: dict[str, Any] = {"loaded_events": None, "bad_lines": 0, "uploads": 0, "purged_below": None}
        self.cards = None if options.cards is None else CardWatch(
            fleet, open_discovery(options.cards), options.namespace, (options.component, options.endpoint),
            options.block_sizes)
        self._publishes: set[asyncio.Task[None]] = set()

    # ----- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Connect in the background (retrying with backoff), so the HTTP API is up even while NATS is not."""
        self._spawn(self._run())

    async def close(self) -> None:
        self._closing = True
        with contextlib.suppress(ValueError):
            self.fleet.clear_listeners.remove(self.losses.cleared)
        await self._stop_tasks()
        if self.cards is not None:
            await self.cards.close()
        if self.nc is not None and not self.nc.is_closed:
            # close, not drain: a cancelled pull fetch keeps drain waiting for its whole timeout; what is
            # unacked is redelivered to the durable consumer, and our own publishes are flushed by close
            with contextlib.suppress(Exception):  # closing a connection already lost must not fail shutdown
                await asyncio.wait_for(self.nc.close(), STOP_TIMEOUT_S)  # nor hang it
        self.state = "closed"

    async def _run(self) -> None:
        if self.cards is not None:  # before the first event: each then goes to the model its worker's card names
            await self.cards.first()
            self._supervise(self.cards.run)
        self.nc = await self._connect()
        nc = self.nc
        self.losses.connected(server_id(nc))
        self.sub = await nc.subscribe(self.scope.subscription, cb=self._on_message,
                                      pending_msgs_limit=self.options.pending_msgs,
                                      pending_bytes_limit=self.options.pending_bytes)
        if self.options.replica_sync and not self.options.shadow:
            self.fleet.sequence_listener = self._publish_sequence
        if self.options.jetstream:
            await self._start_jetstream()
        await barrier(nc)  # the server has every subscription: from here on nothing published is missed
        self.ready_at = time.monotonic()
        self._started.set()
        log.info("event plane: following %s on %s%s", self.scope.pattern("*"), self.options.url,
                 f" (KV events from JetStream stream {self.names.stream})" if self.options.jetstream else "")

    async def _connect(self) -> nats.NATS:
        tries = 0
        while True:
            try:
                nc = await connect(self.options.connection, reconnect=BACKOFF,
                                   name=f"kvctl-router-{self.options.router_id}", on_error=self._error,
                                   on_disconnected=self._disconnected, on_reconnected=self._reconnected,
                                   on_closed=self._closed)
            except Unreachable as exc:
                self._report(exc.message, "retrying with backoff up to 10 s")
                await asyncio.sleep(BACKOFF.delay(tries))
                tries += 1
                continue
            self.connects += 1
            self.state = "connected"
            self._logged_errors.clear()
            return nc

    async def _disconnected(self) -> None:
        if self._closing:  # nats-py says so of its own close too: that loses nothing
            return
        self.state = "reconnecting"
        self.losses.disconnected(self.sub.pending_msgs if self.sub is not None else 0)
        log.warning("event plane: disconnected from %s", self.options.url)

    async def _reconnected(self) -> None:
        self.state = "connected"
        self.reconnects += 1
        self._logged_errors.clear()
        if self.nc is not None:
            self.losses.connected(server_id(self.nc))
        log.info("event plane: reconnected to %s", self.options.url)

    async def _closed(self) -> None:
        self.state = "closed"

    async def _error(self, exc: Exception) -> None:
        if isinstance(exc, nats.errors.SlowConsumerError):
            self.counts["slow_consumer_drops"] += 1  # a message nats-py dropped: we could not keep up
            self.last_error = error_text(exc)
            if exc.sub is self.sub:  # not a JetStream fetch's: what it drops is delivered again
                self.losses.dropped(exc.subject, exc.sub.pending_msgs)
            return
        self._report(f"NATS at {self.options.url} reports {error_text(exc)}", "retrying")

    def _report(self, error: str, then: str) -> None:
        """Status always shows the last error; the log says each different one once (a wrong password is
        refused on every retry: one line, not one a second), and again after a successful connection."""
        self.last_error = error
        if error not in self._logged_errors and len(self._logged_errors) < LOGGED_ERRORS_MAX:
            self._logged_errors.add(error)
            log.warning("event plane: %s; %s", error, then)

    # ----- messages -----------------------------------------------------------------------------------

    async def _on_message(self, msg: Msg) -> None:
        """Every message of the namespace: counted by subject, then ingested if in scope."""
        await self._slices.tick()
        subject = msg.subject
        self.losses.taken += 1
        if subject in self.subjects_seen or len(self.subjects_seen) < SUBJECTS_SEEN_MAX:
            self.subjects_seen[subject] += 1
        else:
            self.subjects_seen["(others)"] += 1
        where = self.scope.match(subject)
        if where is not None:
            await self.ingest.receive(*where, msg.data)

    # ----- JetStream ----------------------------------------------------------------------------------

    async def _start_jetstream(self) -> None:
        assert self.nc is not None
        js = self.nc.jetstream()
        stream = self.names.stream
        if self.options.shadow:
            try:
                await js.stream_info(stream)
            except nats.js.errors.NotFoundError:
                raise RuntimeError(f"stream {stream} does not exist (a shadow router creates nothing)") from None
        else:
            await ensure_stream(js, stream)
        if self.options.reset_states and not self.options.shadow:
            await js.purge_stream(stream)
            with contextlib.suppress(nats.js.errors.NotFoundError, nats.js.errors.BucketNotFoundError):
                await js.delete_object_store(self.names.bucket)
            log.warning("event plane: --reset-states purged stream %s and deleted bucket %s", stream,
                        self.names.bucket)
        else:
            await self._load_snapshot(js)
        config = ConsumerConfig(ack_policy=AckPolicy.ALL, deliver_policy=DeliverPolicy.ALL,
                                inactive_threshold=CONSUMER_INACTIVE_S)
        durable = None if self.options.shadow else str(self.options.router_id)
        if durable is not None:  # from the stream's first message again: the snapshot covers what is gone
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await js.delete_consumer(stream, durable)
        sub = await js.pull_subscribe(self.names.stream_subject, durable=durable, stream=stream, config=config)
        self._spawn(self._consume(sub))
        if not self.options.shadow:
            self._spawn(self._snapshot_loop(js))

    async def _consume(self, sub: Any) -> None:
        while True:
            try:
                msgs = await sub.fetch(FETCH_BATCH, timeout=1.0)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            except (nats.errors.ConnectionClosedError, nats.errors.Error) as exc:
                self.last_error = error_text(exc)
                await asyncio.sleep(0.5)  # reconnecting: the durable consumer keeps our place
                continue
            if not msgs:  # nats-py 2.16 answers a status on its long poll (404, 408, 409) with an empty batch
                continue
            for msg in msgs:
                self.counts["messages"] += 1
                try:
                    event = decode_router_event_json(msg.data)
                except DecodeError as exc:
                    self.errors[exc.kind.value] += 1
                    continue
                events = self.ingest.take_durable(event)
                if events:  # a durable source waits for room rather than drop: what is unacked stays stored
                    await self.writer.put_wait((event.worker_id, event.dp_rank), events)
            await self.writer.applied()  # everything fetched is in the index: ack it (AckAll: the last one)
            with contextlib.suppress(nats.errors.Error):  # a lost ack is a redelivery, and applying is idempotent
                await msgs[-1].ack()

    async def _load_snapshot(self, js: Any) -> None:
        previous: bytes | None = None
        for _ in range(SNAPSHOT_READS):  # an upload in progress reads differently twice in a row
            data = await radix_state(js, self.names.bucket)
            if data is None:
                log.info("event plane: no snapshot %s/%s; reading the whole stream", self.names.bucket,
                         RADIX_STATE_OBJECT)
                return
            if data == previous:
                break
            previous = data
            await asyncio.sleep(0.1)
        # A damaged line costs that line, not the plane: the stream is still followed, and what the line
        # held comes back when its worker stores it again.
        events: list[RouterEvent] = []
        bad: Counter[str] = Counter()
        for line in (previous or b"").splitlines():
            if line.strip():
                try:
                    events.append(decode_router_event_json(line))
                except DecodeError as exc:
                    bad[exc.kind.value] += 1
        applied, rejected = self.fleet.apply(self.options.model, events, time.monotonic())
        self.snapshot["loaded_events"] = applied
        self.snapshot["bad_lines"] = sum(bad.values())
        self.errors.update(bad)
        log.info("event plane: loaded %s from %s/%s (%d rejected)", counted(applied, "event"), self.names.bucket,
                 RADIX_STATE_OBJECT, sum(rejected.values()))
        if bad:
            log.warning("event plane: %s of %s/%s not RouterEvent JSON (%s); skipped, the index "
                        "lacks what they held until their workers store it again", counted(sum(bad.values()), "line"),
                        self.names.bucket, RADIX_STATE_OBJECT, ", ".join(f"{k}: {n}" for k, n in sorted(bad.items())))

    async def _snapshot_loop(self, js: Any) -> None:
        while True:
            await asyncio.sleep(SNAPSHOT_CHECK_S)
            try:
                info = await js.stream_info(self.names.stream)
                if info.state.messages > self.options.snapshot_threshold:
                    await self._snapshot_and_purge(js)
            except nats.errors.Error as exc:  # NATS away: the next check retries
                self.last_error = error_text(exc)

    async def _snapshot_and_purge(self, js: Any) -> None:
        """Purge below the lowest ack floor, then upload the index: it holds everything purged (this router
        acks only what it applied), so snapshot + what the stream keeps rebuilds the whole index."""
        stream = self.names.stream
        floors = [c.ack_floor.stream_seq for c in await js.consumers_info(stream) if c.ack_floor is not None]
        if not floors or min(floors) == 0:
            return
        below = min(floors) + 1
        await js.purge_stream(stream, seq=below)
        edges = self.fleet.model(self.options.model).router.index.capture()
        data = await asyncio.to_thread(lambda: b"".join(encode_router_event_json(e) + b"\n" for e in events_of(edges)))
        try:
            store = await js.object_store(self.names.bucket)
        except (nats.js.errors.NotFoundError, nats.js.errors.BucketNotFoundError):
            store = await js.create_object_store(self.names.bucket)
        await store.put(RADIX_STATE_OBJECT, data)
        self.snapshot["uploads"] += 1
        self.snapshot["purged_below"] = below
        log.info("event plane: snapshot of %s uploaded to %s; stream purged below seq %d", counted(len(edges), "event"),
                 self.names.bucket, below)

    # ----- replica sync -------------------------------------------------------------------------------

    def _publish_sequence(self, model: str, action: str, request: ActiveRequest | None,
                          route: Mapping[str, Any]) -> None:
        found = self.ingest.sequence_event(model, action, request, route)
        if found is None or self.nc is None:
            return
        where, event = found
        subject = self.scope.names(*(where or (None, None))).active_sequences
        body = self._sequence_writer.wrap(encode_sequence_event(event), int(time.time() * 1000))
        task = asyncio.get_running_loop().create_task(self.nc.publish(subject, body))
        self._publishes.add(task)
        task.add_done_callback(self._publishes.discard)

    # ----- views --------------------------------------------------------------------------------------

    def worker_sources(self) -> list[dict[str, Any]]:
        """Where each worker's KV events come from (its publisher, its last event id), for `/v1/workers`."""
        return self.ingest.sources()

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        kv_events = self.names.stream_subject if self.options.jetstream else self.scope.pattern(KV_EVENTS)
        return {
            "url": self.options.url, "state": self.state, "ready": self._started.is_set(),
            "following_s": None if self.ready_at is None else round(now - self.ready_at, 3),
            "connects": self.connects, "reconnects": self.reconnects,
            "last_error": self.last_error, "namespace": self.options.namespace,
            "component": self.options.component, "endpoint": self.options.endpoint, "model": self.options.model,
            "router_id": self.options.router_id,
            "mode": "jetstream" if self.options.jetstream else "core", "shadow": self.options.shadow,
            "replica_sync": self.options.replica_sync,
            "subjects": {"subscription": self.scope.subscription, "kv_events": kv_events,
                         **{topic: self.scope.pattern(topic) for topic in TOPICS if topic != KV_EVENTS}},
            "subjects_seen": dict(self.subjects_seen.most_common()),
            **self.ingest.status(),
            "losses": self.losses.status(),
            "snapshot": dict(self.snapshot) if self.options.jetstream else None,
            "model_cards": None if self.cards is None else self.cards.status(),
        }
