"""`kvctl serve` as a process: serve HTTP on the port it bound (`listen`), announce the URL, run the engine streams,
shut down cleanly.

The first SIGINT/SIGTERM drains and stops: connections in flight get `--shutdown-timeout` seconds to
finish, then are dropped. A second one forces the exit at once. Either way the final snapshot is written
(a third signal ends the process even then), and a forced exit is an error (exit 1), since it dropped
whatever was in flight.

A restart serves at once: the port is bound before this module loads and answered before the state dir is
restored, and the restore runs on the event loop a slice at a time (`SLICE_S`), so `/healthz` and `/readyz`
answer throughout and routes are refused with "restoring" until the index is whole (`readiness`). Engine
streams, the event plane, the state log and its compaction start once it is. Under systemd (`Type=notify`) the
router says READY=1 once the index is whole, not at bind: READY is systemd's one "started" moment, and the units
ordered after the router want routes that see the whole index; until then STATUS= lines say how far the restore
is, and the watchdog is kept from the start of serving. STOPPING=1 comes as the drain begins (see `sd_notify`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
import zmq
import zmq.asyncio

from kvctl.core.names import DEFAULT_BLOCK_SIZE
from kvctl.core.router.approx import ApproxConfig
from kvctl.core.router.busy import Thresholds
from kvctl.core.router.policy_classes import QueueProfiles
from kvctl.core.router.scoring import RouterConfig
from kvctl.core.router.sequences import EXPIRY_S
from kvctl.core.router.sessions import SessionBook
from kvctl.core.tracking_hash import TrackingKey
from kvctl.core.words import counted
from kvctl.errors import KvctlError
from kvctl.runtime import survivors_frozen, trim_heap
from kvctl.server.budget import RECLAIM_ENTRIES, SLICE_S
from kvctl.server.http.api import (
    MAX_BODY_BYTES,
    create_app,
    h11_limits,
    http_protocol,
    loop_lag_observer,
    metrics_registry,
)
from kvctl.server.http.route_protocol import (
    HEAD_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_HEAD_BYTES,
    Connections,
)
from kvctl.server.ingest.decode_process.parent import make_decoder
from kvctl.server.ingest.fd_limits import default_max_engines, raise_file_limit, sized
from kvctl.server.ingest.streams import QUEUE_BATCHES, Streams
from kvctl.server.listen import base_url, is_loopback
from kvctl.server.persistence import compact, gaps, replay, snapshot
from kvctl.server.persistence.compact import COMPACT_BYTES
from kvctl.server.persistence.state_log import BACKLOG, LogCollector, StateLog
from kvctl.server.readiness import Readiness
from kvctl.server.route_limits import RouteLimits
from kvctl.server.sd_notify import Notifier
from kvctl.server.serve_choices import DecoderMode, LogLevel
from kvctl.server.state import Fleet
from kvctl.server.worker_info import WorkerInfo
from kvctl.zmq_limits import MAX_MESSAGE_BYTES

if TYPE_CHECKING:  # loaded only where an event plane is asked for: nats-py and httpx slow every start
    from kvctl.server.http.metrics import Plane
    from kvctl.server.plane.nats_plane import NatsOptions
    from kvctl.server.plane.zmq_plane import ZmqOptions

log = logging.getLogger("kvctl.serve")
TICK_S = 1.0
"""How often stale requests are force-freed and approximate-mode blocks expire."""
ROUTE_QUIET_S = 0.25
"""How long without a route before freed index memory is given back (see `reclaim_when_idle`)."""
SHUTDOWN_TIMEOUT_S = 10.0
LOOP_PROBE_S = 0.01
"""How often the loop is probed for lag (see `watch_loop`): 100 wake-ups a second, ~0.1% of a core."""
STATE_DIR_FIX = ("find what cut, deleted or filled the state dir's files (a full disk? a cleanup job?); the index "
                 "fills again as the engines store blocks; `kvctl router reset --yes` starts it over and clears this "
                 "(docs/runbook.md, part:state_dir)")


class _Server(uvicorn.Server):
    """uvicorn re-raises the stopping signal once drained (the process then dies of SIGTERM); a router
    that drained and stopped cleanly exits 0. A second signal, SIGTERM as well as SIGINT (uvicorn's
    own only takes SIGINT), forces the exit: connections are dropped without waiting. systemd hears of
    both moments that matter to it: the index whole (READY=1, see `_become_ready`) and the drain beginning
    (STOPPING=1)."""

    forced_by: str | None = None  # the signal that forced the exit

    def __init__(self, config: uvicorn.Config, notifier: Notifier, on_started: Callable[[], None],
                 stopping_status: str) -> None:
        super().__init__(config)
        self.notifier = notifier
        self.on_started = on_started  # once connections are accepted: the restore begins (systemd hears at its end)
        self.stopping_status = stopping_status

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self.on_started()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.notifier.stopping(self.stopping_status)
        await super().shutdown(sockets=sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit and self.forced_by is None:
            self.forced_by = signal.Signals(sig).name
            self.force_exit = True
            asyncio.get_running_loop().call_soon_threadsafe(self._drop_connections)
        super().handle_exit(sig, frame)

    def _drop_connections(self) -> None:
        for connection in list(self.server_state.connections):
            connection.transport.abort()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    """What `kvctl serve` was asked for. Keyword-only: twenty-odd fields, many of one type, are too easy to
    pass in the wrong order."""

    host: str = "127.0.0.1"
    port: int = 7433
    block_size: int = DEFAULT_BLOCK_SIZE
    admin_token: str | None = None
    insecure: bool = False
    engines: list[WorkerInfo] = field(default_factory=list)  # --worker flags and the config file's workers
    log_level: LogLevel = LogLevel.warning
    state_dir: Path | None = None  # None: no snapshots
    snapshot_interval_s: float = 60.0  # state log fsync and compaction check (approximate mode: full images)
    compact_log_bytes: int = COMPACT_BYTES  # the least state log worth compacting into a new image
    state_log_backlog: int = BACKLOG  # changes waiting for the disk past which the state log drops them
    restore: bool = True
    reset_states: bool = False
    router: RouterConfig = field(default_factory=RouterConfig)
    thresholds: Thresholds = field(default_factory=Thresholds)
    queues: QueueProfiles | None = None  # the frontend's router queue's policy classes: their verdict per pick
    sessions: SessionBook | None = None  # session affinity (--router-session-affinity-ttl-secs)
    tracking: TrackingKey | None = None  # keyed tracking hashes (--router-tracking-hash keyed-xxh3-v1)
    approx: ApproxConfig | None = None  # approximate mode: no KV events, the router indexes its decisions
    request_expiry_s: float = EXPIRY_S
    models: list[Any] = field(default_factory=list)  # config_file.ModelSpec, declared before anything else
    nats: NatsOptions | None = None  # follow a Dynamo event plane
    zmq_plane: ZmqOptions | None = None  # follow Dynamo's ZMQ event plane (its default) instead
    queue_batches: int = QUEUE_BATCHES  # decoded batches a model's writer holds before dropping (counted)
    max_body_bytes: int = MAX_BODY_BYTES  # larger request bodies are refused (413)
    idle_timeout_s: float = IDLE_TIMEOUT_S  # see route_protocol.Connections
    max_connections: int = MAX_CONNECTIONS
    max_head_bytes: int = MAX_HEAD_BYTES  # a request head's size at most (431)
    head_timeout_s: float = HEAD_TIMEOUT_S  # a request head's time at most (408)
    route_fast_path: bool = True  # plain routes answered in the HTTP protocol (route_protocol.py)
    shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S  # what connections in flight get to finish on SIGTERM
    limits: RouteLimits = field(default_factory=RouteLimits)  # what a route may make the router hold (429)
    decoder: DecoderMode = DecoderMode.auto  # where engine payloads are decoded (see ingest/decode_process/parent.py)
    max_engines: int | None = None  # engine endpoints followed at most; None: as the file limit allows
    max_zmq_message_bytes: int = MAX_MESSAGE_BYTES  # a ZMQ frame's most from an engine or publisher (zmq_limits)


async def run(options: ServeOptions, sock: socket.socket, announce: Callable[[str], None]) -> None:
    """Serve on `sock` (`listen.bind`: listening already, so that connections wait rather than being refused while
    this module loads), and `announce` its URL once the server takes them."""
    notifier = Notifier.from_environment()  # first: no child process may inherit NOTIFY_SOCKET
    fleet = Fleet(block_size=options.block_size, config=options.router, thresholds=options.thresholds,
                  approx=options.approx, request_expiry_s=options.request_expiry_s, limits=options.limits,
                  queues=options.queues, sessions=options.sessions, tracking=options.tracking)
    for spec in options.models:
        fleet.add_model(spec.name, block_size=spec.block_size, config=options.router.override(**spec.router))
        if spec.thresholds:
            fleet.thresholds.set(spec.name, **spec.thresholds)
    with survivors_frozen():  # the restored index included: each collection walks only the newest objects
        await _serve(fleet, options, sock, announce, notifier)


@dataclass
class _Running:
    """What the daemon starts once the index is whole, for the shutdown to stop and flush."""

    background: list[asyncio.Task[None]] = field(default_factory=list)
    restore: asyncio.Task[None] | None = None
    state_log: StateLog | None = None
    snapshots: snapshot.Writer | None = None


async def _serve(fleet: Fleet, options: ServeOptions, sock: socket.socket, announce: Callable[[str], None],
                 notifier: Notifier) -> None:
    files = raise_file_limit()  # before the decode process starts: it inherits the limit
    context = sized(zmq.asyncio.Context())
    max_engines = options.max_engines or default_max_engines(files, context.get(zmq.MAX_SOCKETS))
    log.info("following at most %s (file limit %d)", counted(max_engines, "engine endpoint"), files)
    streams = Streams(fleet, queue_batches=options.queue_batches, decoder=make_decoder(options.decoder),
                      context=context, max_engines=max_engines, max_message_bytes=options.max_zmq_message_bytes)
    plane: Plane | None = None
    if options.nats is not None:
        from kvctl.server.plane.nats_plane import EventPlane

        plane = EventPlane(fleet, streams, options.nats)
    elif options.zmq_plane is not None:
        from kvctl.server.plane.zmq_plane import ZmqPlane

        plane = ZmqPlane(fleet, streams, replace(options.zmq_plane, http_listen=sock.getsockname()[:2]))
    readiness = Readiness(restoring=options.state_dir is not None)
    connections = Connections(options.idle_timeout_s, options.max_connections, options.max_head_bytes,
                              options.head_timeout_s)
    app = create_app(fleet, admin_token=options.admin_token, streams=streams, plane=plane,
                     max_body_bytes=options.max_body_bytes, readiness=readiness, connections=connections)
    if not options.admin_token and not is_loopback(options.host):
        log.warning("serving on %s without an admin token (--insecure): anyone who can reach it can change "
                    "the index, workers and thresholds", options.host)
    # log_config=None: uvicorn's own lines go through the handler `--log-format` chose (JSON stays JSON).
    # The idle timeout is the protocol's own (route_protocol.Connections), not uvicorn's keep-alive one.
    url = base_url(sock)
    protocol = http_protocol(app, fast_path=options.route_fast_path)
    # uvicorn's own protocol (its internals changed) keeps the connection limits its own way, as near as it can.
    limits: dict[str, Any] = {} if protocol != "h11" else h11_limits(connections)
    running = _Running([asyncio.create_task(watch_loop(loop_lag_observer(app), LOOP_PROBE_S)),
                        asyncio.create_task(notifier.keep_alive())])
    server: _Server

    def restore() -> None:
        running.restore = asyncio.create_task(_become_ready(fleet, options, readiness, notifier, url, streams,
                                                            plane, app, running))
        running.restore.add_done_callback(lambda task: _stop_on_failure(task, server))

    server = _Server(uvicorn.Config(app, http=protocol, log_config=None, log_level=options.log_level,
                                    access_log=False, lifespan="off", proxy_headers=False, server_header=False,
                                    # uvicorn types it int, yet hands it to asyncio.wait_for (float seconds)
                                    timeout_graceful_shutdown=options.shutdown_timeout_s,  # type: ignore[arg-type]
                                    **limits),
                     notifier, restore,
                     f"draining connections (up to {options.shutdown_timeout_s:g} s), then the state log's fsync")
    announce(url)
    try:
        await server.serve(sockets=[sock])
    finally:
        if running.restore is not None and not running.restore.done():  # a stop while restoring
            running.restore.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running.restore
        if plane is not None:
            await plane.close()
        await streams.close()
        context.destroy(linger=0)
        for task in running.background:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        sock.close()
        if running.state_log is not None:  # what changed since the last fsync: no image, so the exit is quick
            running.state_log.close()
        if running.snapshots is not None:  # only once restored: a partial index must not replace the image
            try:  # after a periodic write still in flight (cancelling its task does not stop its thread)
                path = running.snapshots.write(running.snapshots.capture(fleet, time.time()))
                log.info("snapshot written to %s", path)
            except OSError as exc:  # the previous snapshot is still there: a restart loses what came since
                log.error("final snapshot to %s failed: %s", options.state_dir, exc)
    failed = running.restore.exception() if running.restore is not None and not running.restore.cancelled() else None
    if failed is not None:
        raise failed
    if server.forced_by is not None:  # stopped, but not cleanly: exit 1
        raise KvctlError(f"a second {server.forced_by} forced the exit: connections in flight were dropped")


def _stop_on_failure(task: asyncio.Task[None], server: _Server) -> None:
    """A restore that failed (an unreadable state dir) stops the router, as a failed start did: `_serve` raises
    its error once the server is down, rather than serving "restoring" for ever."""
    if not task.cancelled() and task.exception() is not None:
        server.should_exit = True


async def _become_ready(fleet: Fleet, options: ServeOptions, readiness: Readiness, notifier: Notifier, url: str,
                        streams: Streams, plane: Plane | None, app: Any, running: _Running) -> None:
    """Restore the state dir on the loop, then start what feeds the index and what persists it; then ready."""
    restored = await _restore(fleet, options, readiness, notifier)
    fleet.mark_restored()
    for info in options.engines:
        fleet.register(info)
    for info in list(fleet.workers.values()):  # restored from the snapshot
        streams.start(info)
    if plane is not None:
        plane.start()
    fleet.audit.soon = asyncio.get_running_loop().call_soon
    running.background += [asyncio.create_task(_tick_every(fleet, streams, TICK_S)),
                           asyncio.create_task(_reclaim_every(fleet, streams, ROUTE_QUIET_S))]
    if options.state_dir is not None and fleet.approx is not None:  # its index changes with every route
        running.snapshots = snapshot.Writer(options.state_dir)
        running.background.append(asyncio.create_task(
            _snapshot_every(fleet, running.snapshots, options.snapshot_interval_s)))
    elif options.state_dir is not None:
        assert restored is not None  # with a state dir, _load_state always says what it restored
        running.state_log = StateLog(options.state_dir, fleet, restored_from=restored["log_from"],
                                      position=restored["log_pos"], backlog=options.state_log_backlog)
        running.state_log.stats.lost = restored["lost"] is not None  # an image of what there is, at once
        metrics_registry(app).register(LogCollector(running.state_log.stats))
        restored["log"] = running.state_log.stats
        running.background.append(asyncio.create_task(compact.keep(
            running.state_log, fleet, interval_s=options.snapshot_interval_s,
            compact_bytes=options.compact_log_bytes, block_size=options.block_size)))
    readiness.finish(restored)
    notifier.ready(_ready_status(url, restored))


async def _restore(fleet: Fleet, options: ServeOptions, readiness: Readiness,
                   notifier: Notifier) -> dict[str, Any] | None:
    """`_load_state` a slice of the loop at a time (`SLICE_S`), its progress in `readiness` and in systemd's
    STATUS= line (at the first slice's end, then once a second)."""
    steps = _load_state(fleet, options)
    end = time.perf_counter() + SLICE_S
    told = time.monotonic() - 1.0
    while True:
        try:
            progress = next(steps)
        except StopIteration as done:
            return done.value
        if time.perf_counter() >= end:
            readiness.step(progress)
            if time.monotonic() - told >= 1.0:
                notifier.status(readiness.line())
                told = time.monotonic()
            await asyncio.sleep(0)
            end = time.perf_counter() + SLICE_S


def _ready_status(url: str, restored: dict[str, Any] | None) -> str:
    """What `systemctl status` shows beside the unit once the router answers."""
    parts = [f"serving {url}"]
    if restored is not None and restored["lost"] is not None:  # never a partial index told as whole
        parts.append(f"PARTIAL index, {restored['lost']['reason']}")
    if restored is not None and restored["file"] is not None:
        parts.append(f"{counted(restored['events'], 'event')} restored from {restored['file']}")
    if restored is not None and restored["log_records"]:
        parts.append(f"{counted(restored['log_records'], 'state log record')} replayed")
    return ", ".join(parts)


def _load_state(fleet: Fleet, options: ServeOptions) -> Generator[snapshot.Progress, None, dict[str, Any] | None]:
    """Restore the snapshot, in slices; returns what `/v1/status` shows of it (None: no state dir; `log_from`
    None: no restore was tried)."""
    if options.state_dir is None:
        return None
    not_restored: dict[str, Any] = {"file": None, "events": 0, "problems": [], "log_records": 0, "log_from": None,
                                    "log_pos": 0, "log_stopped": None, "lost": None}
    if options.reset_states:
        if snapshot.delete(options.state_dir):
            log.warning("--reset-states: deleted the snapshot in %s", options.state_dir)
        return not_restored
    if not options.restore:
        return not_restored
    if options.nats is not None and options.nats.jetstream:
        log.info("JetStream mode: the object-store snapshot and the stream rebuild the index, not %s",
                 options.state_dir)
        return not_restored
    if fleet.approx is not None:
        restored, problems = yield from snapshot.restore_in_slices(fleet, options.state_dir, time.monotonic())
        replayed = None
    else:
        replayed = yield from replay.slices(fleet, options.state_dir, time.monotonic(), repair=True)
        restored, problems = replayed.image, replayed.problems
    for problem in problems:
        log.error("damaged snapshot: %s", problem)
    if replayed is not None and replayed.stopped is not None:
        log.error("state log damaged, replay stopped before it (set aside as .damaged): %s", replayed.stopped)
    if replayed is not None and replayed.unknown_end is not None:
        log.warning("state dir: %s: a log cut short at its end cannot be told from one that ended",
                    replayed.unknown_end)
    lost = replayed.lost(fleet) if replayed is not None else None
    if lost is not None:
        _report_loss(fleet, lost)
    records = replayed.records if replayed is not None else 0
    if restored is not None or records:  # an ordinary restart: INFO (a loss is the ERROR above)
        stamps = [restored.taken_at if restored else None, replayed.written_at if replayed and records else None]
        age = max(0.0, time.time() - max(t for t in stamps if t is not None))
        image = f"{counted(restored.events, 'event')} from {restored.path.name}" if restored else "no image"
        log.info("restored %s and %s, the last written %.1f s ago (%d rejected); engine streams ask their "
                 "replay for the KV events sent after it (what none holds any more is counted lost); events "
                 "sent over HTTP or an event plane meanwhile were not seen",
                 image, counted(records, "state log record"), age, restored.rejected if restored else 0)
    elif problems:
        log.error("no sound snapshot in %s: starting with an empty index", options.state_dir)
    return {"file": restored.path.name if restored is not None else None,
            "events": restored.events if restored is not None else 0, "problems": problems,
            "log_records": records, "log_from": replayed.log_from if replayed is not None else 0,
            "log_pos": replayed.position if replayed is not None else 0,
            "log_stopped": replayed.stopped if replayed is not None else None,
            "lost": lost.status() if lost is not None else None}


def _report_loss(fleet: Fleet, lost: gaps.Lost) -> None:
    """A restore that restored less than the state dir acknowledged: `/readyz` "partial" (routes are answered from
    what there is), ERROR once, each cause counted. It holds until a reset of the whole index, or the process ends;
    the state dir is rewritten at once as an image of what there is, so the next restart reports only new losses."""
    fleet.health.fail("state_dir", lost.reason, STATE_DIR_FIX)
    for cause, n in sorted(lost.by_cause.items()):
        fleet.health.lose("state_dir", cause, n, detail=lost.reason, fix=STATE_DIR_FIX)


async def _tick_every(fleet: Fleet, streams: Streams, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        now = time.monotonic()
        fleet.tick(now)
        streams.sample(now)
        streams.log_gaps()
        await fleet.audit.drain()


async def watch_loop(observe: Callable[[float], None], interval_s: float) -> None:
    """Observe how late each wake-up comes: the router's promise is that nothing holds its loop for more
    than a few milliseconds (ingest works in slices, the GC walks only young objects), and
    `kvctl_event_loop_blocked_seconds_total` (with `kvctl_event_loop_lag_seconds`) is where an operator sees
    whether it keeps it (`server.http.loop_lag`)."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        observe(max(0.0, loop.time() - due))


async def _reclaim_every(fleet: Fleet, streams: Streams, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        await reclaim_when_idle(fleet, streams)


async def reclaim_when_idle(fleet: Fleet, streams: Streams) -> None:
    """Give back the memory of freed index nodes (see `RadixTree.reclaim`) while the router is idle.

    Removals leave it for later so that a burst is applied at the speed of the index, and later is
    here: once no event waits and no route came for `ROUTE_QUIET_S`, a slice at a time, stopping as
    soon as either comes in again; then the freed pages go back to the system. A router that is never
    idle still keeps each lookup within 1.25x its size (`RadixTree._tidy`).
    """
    if not fleet.reclaim_debt():
        return
    while streams.idle() and time.monotonic() - fleet.last_route_at >= ROUTE_QUIET_S:
        start = time.perf_counter()
        if not fleet.reclaim(RECLAIM_ENTRIES):
            trim_heap()
            return
        await asyncio.sleep(2 * (time.perf_counter() - start))


async def _snapshot_every(fleet: Fleet, snapshots: snapshot.Writer, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:  # encoded and written off the loop: only the capture holds it
            await asyncio.to_thread(snapshots.write, snapshots.capture(fleet, time.time()))
        except OSError as exc:  # a full or read-only disk must not stop the router; the next interval retries
            log.error("snapshot to %s failed: %s", snapshots.state_dir, exc)
