"""`kvctl serve --dynamo-discovery`: following a Dynamo fleet's ZMQ event plane, its default (docs/contract.md).

There is no broker: each publisher binds a PUB socket per topic and files an `EventChannel` record in Dynamo's
discovery store. This plane lists the records of its namespace (narrowed by `--component` / `--endpoint`) and
follows their changes (etcd: a watch; files: a poll), keeps one SUB socket connected to each record's endpoint,
and drops it when its record goes (a clean stop deletes the keys; a dead process's vanish within ~12 s). Every
message is four frames (core/events/zmq_wire.py) around the same envelope as on NATS, so it goes to the same
transport-free ingest (plane/ingest.py) as the NATS plane's, under the component and endpoint of the record it
came from; the status keeps the NATS plane's shape, plus the connections. With `--replica-sync` peers'
in-flight requests are taken and, unless `--shadow`, this router's own are shared as a Dynamo router shares
them (zmq_sequences.py). No history: a worker found late has its index recovered over Dynamo's request plane
(recovery.py), from its `v1/event_sources` record.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import zmq
import zmq.asyncio

from kvctl.core.events.discovery import (
    CHANNELS_BUCKET,
    EventChannel,
    address_host,
    namespace_prefix,
    parse_channel_key,
    parse_event_channel,
    unreachable,
)
from kvctl.core.events.errors import DecodeError, ErrorKind
from kvctl.core.events.model_card import cards_prefix
from kvctl.core.events.plane import ACTIVE_SEQUENCES, KV_EVENTS, TOPICS
from kvctl.core.events.publishers import MAX_PUBLISHERS
from kvctl.core.events.request_plane import namespace_sources_prefix
from kvctl.core.events.zmq_wire import decode_zmq_message
from kvctl.core.names import DEFAULT_MODEL, WorkerKey, format_worker
from kvctl.core.router.sequences import ActiveRequest
from kvctl.core.words import counted
from kvctl.errors import DiscoveryError
from kvctl.server.budget import Slices
from kvctl.server.ingest.fd_limits import default_max_engines, file_limit, sized
from kvctl.server.ingest.streams import TOO_LARGE_FIX, ModelWriter, Streams
from kvctl.server.plane.discovery_limits import FIXES
from kvctl.server.plane.dynamo_discovery import KEEP_ALIVE_S, POLL_S, Discovery, follow, open_discovery
from kvctl.server.plane.ingest import PlaneIngest
from kvctl.server.plane.model_cards import CardBlockSizes, CardBook
from kvctl.server.plane.recovery import RECOVERY_TIMEOUT_S, Recovery, RecoveryClient
from kvctl.server.plane.recovery_answers import RECOVERY_MAX_BYTES, AnswerListener
from kvctl.server.plane.replica_sync import PeerLimits
from kvctl.server.plane.tasks import PlaneTasks
from kvctl.server.plane.zmq_sequences import SequenceChannels, default_advertise_host
from kvctl.server.state import Fleet, UnknownWorker
from kvctl.zmq_limits import WATCHED, limited, watch

log = logging.getLogger("kvctl.serve")

CONNECT_WAIT_S = 5.0
"""How long readiness waits for the first listing's sockets to connect (a stale record's never does)."""
LOG_EVERY_S = 60.0
"""A record skipped is logged the first time for its cause, then at most this often: the ledger counts the rest."""
RCVHWM = 100_000
"""Messages a SUB socket holds while the loop is busy; beyond, ZMQ drops them (seen as sequence gaps)."""
RECONNECT_MAX_MS = 5_000
"""A publisher that does not answer is tried again less and less often, up to every 5 s (libzmq's default retries
every 100 ms for ever): 5,000 stale records then cost about a thousand connects a second, and their monitor events,
instead of 50,000 that held the loop most of the time."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ZmqOptions:
    """`kvctl serve --dynamo-discovery`'s plane. Keyword-only, as `ServeOptions` and `NatsOptions`: several strings
    and flags in a row must not be passed by position."""

    discovery: str  # file:DIR, etcd:URL, kubernetes[:NAMESPACE]
    namespace: str = "dynamo"
    component: str | None = None  # None: every component of the namespace
    endpoint: str | None = None  # None: every endpoint
    model: str = DEFAULT_MODEL  # where workers whose card names no model go (no card: a publisher outside Dynamo)
    router_id: int = 0
    replica_sync: bool = False  # take peers' in-flight requests and, unless shadow, share this router's own
    peer_limits: PeerLimits = PeerLimits()  # what replica sync takes from other routers
    shadow: bool = False  # only read: register and publish nothing
    advertise_host: str | None = None  # the host in this router's records (None: the host's own address)
    listen_host: str = "127.0.0.1"  # --listen's: where the recovery answers' listener binds, unless advertise_host
    poll_s: float = POLL_S
    recovery_timeout_s: float = RECOVERY_TIMEOUT_S  # one worker's index recovery over the request plane
    recovery_max_bytes: int = RECOVERY_MAX_BYTES  # one recovery answer's bytes
    max_channels: int | None = None  # channels followed at most (None: as the file limit allows, as --max-engines)
    http_listen: tuple[str, int] | None = None  # this router's HTTP address: a record naming it is skipped
    block_sizes: CardBlockSizes = CardBlockSizes()  # which models take their cards' block size

    @property
    def url(self) -> str:
        """The discovery store, as status, logs and metrics name the plane."""
        return self.discovery


def own_addresses(listen: tuple[str, int] | None) -> frozenset[tuple[str, int]]:
    """Where this router's HTTP listener is reached from this host, as `unreachable` compares addresses: the
    listen address itself and, when it is a wildcard or loopback one, this host's other names for itself."""
    if listen is None:
        return frozenset()
    host, port = listen
    hosts = {host}
    canonical = address_host(host)
    if canonical in ("0.0.0.0", "::"):
        hosts |= {"127.0.0.1", "::1", "localhost", socket.gethostname(), default_advertise_host()}
    elif canonical in ("127.0.0.1", "::1"):
        hosts |= {"127.0.0.1", "::1", "localhost"}
    return frozenset((address_host(h), port) for h in hosts)


@dataclass(eq=False)
class _Link:
    """One SUB socket, connected to one publisher's endpoint for one record."""

    key: str
    channel: EventChannel
    socket: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket
    since: float
    connected: asyncio.Event = field(default_factory=asyncio.Event)
    connects: int = 0
    disconnects: int = 0
    messages: int = 0
    too_large: int = 0  # connections libzmq dropped for a message over the limit (each made again)
    # what its frames said (the record's instance id), the last MAX_PUBLISHERS of them: a flood of ids stays bounded
    publisher_ids: OrderedDict[int, None] = field(default_factory=OrderedDict)
    errors: Counter[str] = field(default_factory=Counter)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def row(self, now: float) -> dict[str, Any]:
        c = self.channel
        return {"address": c.address, "channel": self.key, "topic": c.topic, "publisher_id": c.publisher_id,
                "component": c.component, "endpoint": c.endpoint, "connected": self.connected.is_set(),
                "connects": self.connects, "disconnects": self.disconnects, "messages": self.messages,
                "too_large": self.too_large, "decode_errors": dict(self.errors), "age_s": round(now - self.since, 3)}


class ZmqPlane(PlaneTasks):
    """The ZMQ event plane's transport: discovery in, SUB sockets out, messages to a PlaneIngest."""

    def __init__(self, fleet: Fleet, streams: Streams, options: ZmqOptions,
                 discovery: Discovery | None = None) -> None:
        super().__init__("listing")
        self.fleet = fleet
        self.options = options
        self.discovery = discovery if discovery is not None else open_discovery(options.discovery)
        self.writer: ModelWriter = streams.writer(options.model)
        self.max_message_bytes = streams.max_message_bytes  # the engines' limit (--max-zmq-message-bytes)
        self.ingest = PlaneIngest(fleet, self.writer, model=options.model, router_id=options.router_id,
                                  replica_sync=options.replica_sync, peer_limits=options.peer_limits,
                                  surface="zmq", kv_events=fleet.approx is None)  # approximate: counted only
        self.counts = self.ingest.counts
        listener = AnswerListener(fleet.health, listen_host=options.listen_host,
                                  advertise_host=options.advertise_host, max_bytes=options.recovery_max_bytes)
        self.recovery = self.ingest.recovery = Recovery(self.ingest.apply_recovered, self.counts,
                                                        RecoveryClient(listener, options.recovery_timeout_s),
                                                        fleet.health)
        self.errors = self.ingest.errors
        self.reconnects = 0  # sockets that connected again after losing their publisher
        self.links: dict[str, _Link] = {}
        self.seen: Counter[str] = Counter()  # channels of the namespace by scope and topic: publishers listed
        self.cards = CardBook(options.component, options.endpoint)
        self.record_errors: Counter[str] = Counter()  # records that do not parse, by kind
        self.listings = 0
        self.listed_at: float | None = None
        self.ready_at: float | None = None
        self._skipped: dict[str, tuple[bytes, str]] = {}  # record key -> (value, cause): counted once a version
        self._logged: dict[str, float] = {}  # cause -> when a skipped record of it was last logged
        self._down: str | None = None  # why discovery fails now (a listing, or its loop), None while it works
        self._ctx = sized(zmq.asyncio.Context())  # a fleet of over 500 publishers needs more than ZMQ's 1023
        self.max_channels = options.max_channels or default_max_engines(file_limit(), self._ctx.get(zmq.MAX_SOCKETS))
        self._own = own_addresses(options.http_listen)
        self.discovery.refusals.lose = self._lose
        self.channels: SequenceChannels | None = None
        if options.replica_sync and not options.shadow:
            self.channels = SequenceChannels(self.discovery, options.namespace, options.router_id,
                                             options.advertise_host or default_advertise_host())

    # ----- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> None:
        self._supervise(self._run, self._tasks, self._loop_died)
        if self.channels is not None:
            self.fleet.sequence_listener = self._publish_sequence
            self._supervise(self._keep_alive, self._tasks)

    async def close(self) -> None:
        await self._stop_tasks()
        for key in list(self.links):
            await self._drop(key)
        if self.channels is not None:
            self.fleet.sequence_listener = None
            self.channels.close()
        await self.recovery.close()
        await self.discovery.close()  # this router's records go with it
        self._ctx.destroy(linger=0)
        self.state = "closed"

    async def _run(self) -> None:
        """List and follow the store for ever: a store that fails is tried again after a pause that doubles, up
        to RETRY_MAX_S, while the plane's fault says so (the ledger logs it once)."""
        with contextlib.suppress(OSError):  # the ledger says so; each query tries again
            await self.recovery.client.start()

        async def listed(records: dict[str, bytes]) -> None:
            await self._listed(records)
            self._judge(None)

        def failed(exc: DiscoveryError) -> None:
            self.last_error = str(exc)
            self._judge(f"discovery {self.options.url} fails: {exc}")

        await follow(self.discovery, namespace_prefix(self.options.namespace), self.options.poll_s, listed, failed)

    def _loop_died(self, error: str, backoff_s: float) -> None:
        self.state = "failed"
        self._judge(f"the discovery loop stopped ({error}); it is started again after a backoff")

    def _judge(self, down: str | None) -> None:
        """The plane's fault in the health ledger: `down` says why discovery fails (None: it works, and the fault
        is cleared). It blocks readiness once no live source is left: no channel of kv-events whose socket is
        connected now, so that nothing at all reaches the model's index; while one still is, the index follows
        the publishers it has, and only new or gone ones go unseen: partial."""
        self._down = down
        if down is None:
            self.fleet.health.recover("plane.discovery")
            return
        live = any(link.connected.is_set() for link in self.links.values() if link.channel.topic == KV_EVENTS)
        what = ("the publishers already connected are still followed; new and gone ones are not seen" if live else
                f"no publisher of kv-events is connected: model {self.options.model!r}'s index hears nothing")
        self.fleet.health.fail("plane.discovery", f"{down}; {what}",
                               f"check that {self.options.url} answers from this host, quickly (the runbook's "
                               "part:plane.discovery); kvctl keeps trying", blocks=not live)

    async def _listed(self, records: dict[str, bytes]) -> None:
        """The store's channel records now: follow them, recover the workers new among them, share in their
        scopes, and be ready after the first time."""
        self.listings += 1
        self.listed_at = time.monotonic()
        # The cards first: a worker's events then go to the model its card names from the first one on.
        self.cards.read(await self.discovery.list(cards_prefix(self.options.namespace)))
        self.cards.apply(self.fleet, time.monotonic(), self.options.block_sizes)
        added = await self._follow(records)
        sources = await self.discovery.list(namespace_sources_prefix(self.options.namespace))
        if self.ingest.kv_events:  # approximate mode recovers no index: it is the router's own routes
            self.recovery.follow(sources)  # after the sockets: what the recovery misses, they hold
        if self.channels is not None:
            await self._share()
        if not self._started.is_set():
            await self._first_connections(added)
        self.state = "connected"

    async def _share(self) -> None:
        """A replica-sync channel of this router's in each scope whose workers it follows."""
        assert self.channels is not None
        scopes = {(link.channel.component, link.channel.endpoint) for link in self.links.values()
                  if link.channel.topic != ACTIVE_SEQUENCES}
        try:
            await self.channels.open(scopes)
        except DiscoveryError as exc:  # the next listing tries again
            self.last_error = f"cannot file this router's replica-sync channel: {exc}"
            log.warning("event plane: %s", self.last_error)

    async def _keep_alive(self) -> None:
        """Refresh this router's records, as Dynamo's processes refresh theirs (their readers drop stale ones)."""
        while True:
            await asyncio.sleep(KEEP_ALIVE_S)
            try:
                await self.discovery.keep_alive()
            except DiscoveryError as exc:
                self.last_error = f"cannot refresh this router's discovery records: {exc}"
                log.warning("event plane: %s", self.last_error)

    def _publish_sequence(self, model: str, action: str, request: ActiveRequest | None,
                          route: Mapping[str, Any]) -> None:
        found = self.ingest.sequence_event(model, action, request, route)
        if found is not None and self.channels is not None:
            self.channels.publish(*found)

    async def _first_connections(self, links: list[_Link]) -> None:
        """Ready once the first listing's sockets are connected (or CONNECT_WAIT_S has passed: a stale record
        never connects, and must not keep the router unready)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(link.connected.wait() for link in links)), CONNECT_WAIT_S)
        self.state = "connected"
        self.ready_at = time.monotonic()
        self._started.set()
        log.info("event plane: following %s of namespace %r from %s", counted(len(self.links), "publisher"),
                 self.options.namespace, self.options.url)

    # ----- discovery ----------------------------------------------------------------------------------

    async def _follow(self, records: dict[str, bytes]) -> list[_Link]:
        """Connect to each record's publisher not followed yet, drop those whose record went; the new links. A
        slice of the loop at a time: a store of thousands of records must not hold routes (5,000 held it 0.9 s)."""
        wanted: dict[str, EventChannel] = {}
        seen: Counter[str] = Counter()  # swapped in whole at the end: a status read between slices sees a listing
        self._skipped = {k: v for k, v in self._skipped.items() if k in records}
        slices = Slices()
        for key, value in records.items():
            await slices.tick()
            channel = self._channel(key, value)
            if channel is None:
                continue
            seen[self._pattern(channel.component, channel.endpoint, channel.topic)] += 1
            if self.options.component not in (None, channel.component) or \
                    self.options.endpoint not in (None, channel.endpoint):
                continue
            why = unreachable(channel.address, self._own)
            if why is not None:
                self._skip(key, value, why, f"{key}: {channel.address}")
                continue
            wanted[key] = channel
        self.seen = seen
        wanted = self._capped(wanted, records)
        gone = [k for k, link in self.links.items() if wanted.get(k) != link.channel]
        for key in gone:
            log.info("event plane: publisher %s gone from discovery", key)
        await self._forget_workers([self.links[k] for k in gone if k not in wanted])  # not those that moved
        for key in gone:
            await self._drop(key)
        added = []
        for key, channel in wanted.items():
            await slices.tick()
            if key not in self.links and (link := self._connect(key, channel, records[key])) is not None:
                added.append(link)
        return added

    def _capped(self, wanted: dict[str, EventChannel], records: dict[str, bytes]) -> dict[str, EventChannel]:
        """At most `max_channels` of the channels wanted (those followed already first, so that none churns),
        the rest skipped and counted: each costs four file descriptors, and a store of 7,000 stale records
        must not take them all. While some are refused the index is partial, and the ledger says so."""
        if len(wanted) <= self.max_channels:
            self.fleet.health.recover("plane.channels")
            return wanted
        order = sorted(wanted, key=lambda k: (k not in self.links or self.links[k].channel != wanted[k], k))
        for key in order[self.max_channels:]:
            self._skip(key, records[key], "too_many_channels", f"{key}: past {counted(self.max_channels, 'channel')}")
        self.fleet.health.fail(
            "plane.channels", f"more channels listed than the {self.max_channels} followed (--max-channels): the "
            "workers of the others are missing from the index (lost:discovery too_many_channels counts them)",
            FIXES["too_many_channels"])
        return {k: wanted[k] for k in order[:self.max_channels]}

    def _channel(self, key: str, value: bytes) -> EventChannel | None:
        """The record's channel; None (counted once per version of the record) when key or value are bad."""
        try:
            channel = parse_event_channel(value)
            if parse_channel_key(key) != channel.key:
                raise DecodeError(ErrorKind.bad_type, "key", "the key does not name the record's channel")
        except DecodeError as exc:
            if self._skip(key, value, exc.kind.value, f"{key}: {exc}"):
                self.record_errors[exc.kind.value] += 1
            return None
        return channel

    def _skip(self, key: str, value: bytes, cause: str, detail: str) -> bool:
        """A record not followed, counted in the ledger once per version of it; whether it was new."""
        if self._skipped.get(key) == (value, cause):
            return False
        self._skipped[key] = (value, cause)
        self._lose(cause, detail, FIXES.get(cause, "fix or remove the record in the discovery store"))
        return True

    def _lose(self, cause: str, detail: str, fix: str) -> None:
        """A record or store entry skipped: the ledger counts each, the log says the first of a cause and then
        one a minute at most."""
        self.fleet.health.lose("discovery", cause, detail=detail, fix=fix)
        now = time.monotonic()
        if now - self._logged.get(cause, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[cause] = now
            log.warning("event plane: discovery entry skipped (%s): %s; %s", cause, detail, fix)

    def _pattern(self, component: str | None, endpoint: str | None, topic: str) -> str:
        return (f"{CHANNELS_BUCKET}/namespace/{self.options.namespace}/component/{component or '*'}"
                f"/endpoint/{endpoint or '*'}/topic/{topic}")

    async def _forget_workers(self, going: list[_Link]) -> None:
        """Remove the workers whose last publisher went from discovery, as Dynamo's routers do when an instance
        goes: a stopped worker (and a restarted one, a new identity) must not keep its blocks in the index."""
        book = self.ingest.publishers.publishers

        def spoken(links: list[_Link]) -> set[WorkerKey]:
            return {w for link in links for pid in link.publisher_ids if pid in book for w in book[pid].workers}

        staying = [link for link in self.links.values() if link not in going]
        orphans = sorted(w for w in spoken(going) - spoken(staying) if w in self.fleet.workers)
        if not orphans:
            return
        await self.writer.applied()  # what it sent before it went is in the index: then remove it all
        for worker in orphans:
            with contextlib.suppress(UnknownWorker):
                removed = self.fleet.unregister(*worker)
                self.recovery.forget(worker)
                self.counts["workers_removed"] += 1
                log.warning("event plane: worker %s gone from discovery: removed (%s)", format_worker(worker),
                            counted(removed.blocks, "block"))

    # ----- sockets ------------------------------------------------------------------------------------

    def _connect(self, key: str, channel: EventChannel, value: bytes) -> _Link | None:
        """A SUB socket following the channel; None (skipped, counted) when ZMQ refuses it (out of descriptors,
        an address it cannot use)."""
        sock = monitor = None
        try:
            sock = limited(self._ctx.socket(zmq.SUB), self.max_message_bytes)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, RCVHWM)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            monitor = sock.get_monitor_socket(WATCHED)
            sock.connect(channel.address)
        except zmq.ZMQError as exc:
            for opened in (monitor, sock):
                if opened is not None:
                    opened.close(linger=0)
            self._skip(key, value, "connect_failed", f"{key}: {channel.address}: {exc}")
            return None
        link = _Link(key, channel, sock, monitor, time.monotonic())
        self.links[key] = link
        self._skipped.pop(key, None)  # followed now: refused again, it counts again
        self._supervise(partial(self._watch, link), link.tasks)
        self._supervise(partial(self._receive, link), link.tasks)
        log.info("event plane: following %s (%s of publisher %d) at %s", key, channel.topic, channel.publisher_id,
                 channel.address)
        return link

    async def _drop(self, key: str) -> None:
        link = self.links.pop(key, None)
        if link is None:
            return
        await self._stop_tasks(link.tasks)
        with contextlib.suppress(zmq.ZMQError):
            link.socket.disable_monitor()
        link.monitor.close(linger=0)
        link.socket.close(linger=0)

    async def _watch(self, link: _Link) -> None:
        """The socket's connects and disconnects: status says which publishers are reachable right now; one that
        libzmq dropped for too large a message is connected again, and counted."""

        def seen(event: int) -> None:
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.connects += 1
                if link.connects > 1:
                    self.reconnects += 1
                link.connected.set()
            elif event == zmq.EVENT_DISCONNECTED:
                link.disconnects += 1
                link.connected.clear()
            if self._down is not None:  # whether a live source is left may have changed
                self._judge(self._down)

        await watch(link.socket, link.monitor, lambda _: self._dropped(link), seen)

    def _dropped(self, link: _Link) -> None:
        where = f"publisher {link.channel.publisher_id} at {link.channel.address} ({link.key})"
        if not link.too_large:
            log.warning("event plane: %s sent a message over %s bytes (--max-zmq-message-bytes): its connection was "
                        "dropped and made again; further ones are counted", where,
                        f"{self.max_message_bytes:,}")
        link.too_large += 1
        self.fleet.health.lose("zmq", "too_large", detail=f"{where}: a message over "
                               f"{self.max_message_bytes:,} bytes (or a malformed ZMTP frame); its connection "
                               "was dropped and made again", fix=TOO_LARGE_FIX)

    async def _receive(self, link: _Link) -> None:
        channel, slices = link.channel, Slices()
        while True:
            await slices.tick()
            frames = await link.socket.recv_multipart()
            link.messages += 1
            try:
                message = decode_zmq_message(frames)
            except DecodeError as exc:
                link.errors[exc.kind.value] += 1
                self.errors[exc.kind.value] += 1
                continue
            ids = link.publisher_ids
            if message.publisher_id in ids:
                ids.move_to_end(message.publisher_id)
            else:
                ids[message.publisher_id] = None
                if len(ids) > MAX_PUBLISHERS:
                    ids.popitem(last=False)
            if message.topic != channel.topic:
                self.counts["topic_mismatches"] += 1  # ingested by what the message says it is
            await self.ingest.receive(channel.component, channel.endpoint, message.topic, message.envelope)

    # ----- views --------------------------------------------------------------------------------------

    def _addresses(self) -> dict[int, str]:
        """Each followed publisher's advertised address, by its id."""
        return {link.channel.publisher_id: link.channel.address for link in self.links.values()}

    def worker_sources(self) -> list[dict[str, Any]]:
        return self.ingest.sources(self._addresses())

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        o = self.options
        scope = (o.component, o.endpoint)
        ingest = self.ingest.status()
        addresses = self._addresses()
        return {
            "transport": "zmq", "url": o.url, "state": self.state, "ready": self._started.is_set(),
            "following_s": None if self.ready_at is None else round(now - self.ready_at, 3),
            "connects": sum(link.connects for link in self.links.values()), "reconnects": self.reconnects,
            "last_error": self.last_error, "namespace": o.namespace, "component": o.component,
            "endpoint": o.endpoint, "model": o.model, "router_id": o.router_id, "mode": "core",
            "shadow": self.channels is None, "replica_sync": o.replica_sync,
            "sharing": None if self.channels is None else {"channels": self.channels.rows(),
                                                           "unplaced": self.channels.unplaced},
            "subjects": {"subscription": namespace_prefix(o.namespace), "kv_events": self._pattern(*scope, KV_EVENTS),
                         **{topic: self._pattern(*scope, topic) for topic in TOPICS if topic != KV_EVENTS}},
            "subjects_seen": dict(self.seen.most_common()),
            **ingest,
            "publishers": [{**row, "address": addresses.get(row["publisher_id"])} for row in ingest["publishers"]],
            "workers": self.ingest.sources(addresses),
            "snapshot": None,
            "discovery": {"url": o.url, "listings": self.listings, "poll_s": o.poll_s,
                          "follows": self.discovery.follows,
                          "listed_age_s": None if self.listed_at is None else round(now - self.listed_at, 3),
                          "record_errors": dict(self.record_errors), "stray": dict(self.discovery.refusals.counts),
                          "expired": self.discovery.expired, "max_channels": self.max_channels},
            "connections": [link.row(now) for _, link in sorted(self.links.items())],
            "recovery": self.recovery.status(),
            "model_cards": self.cards.status(),
        }
