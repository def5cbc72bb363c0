"""`kvctl events tail/record --nats`: a Dynamo event plane on NATS Core, or kvctl's JetStream stream, heard
without a router; counted and judged as every tap is (`kvctl.event_taps`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING

from kvctl.core.events.dynamo import decode_router_event_json
from kvctl.core.events.plane import ACTIVE_SEQUENCES, KV_EVENTS, PlaneScope
from kvctl.core.events.publishers import Numbering
from kvctl.core.names import WorkerKey
from kvctl.event_taps import POLL_MS, Decoded, Tapped, TapStats, plane_message, tapped_events, unheard
from kvctl.nats.barrier import barrier
from kvctl.nats.connection import NatsConnection, Reconnect, connect, unreachable

if TYPE_CHECKING:
    import nats
    from nats.aio.msg import Msg

FOLLOW = Reconnect(first_s=2.0, max_s=2.0)
"""A tap outlives a server restart: it tries again every 2 s (nats-py's default pace) until its end."""


async def tap_nats(conn: NatsConnection, scope: PlaneScope, *, stop: Callable[[], bool], stats: TapStats,
                   jetstream: bool = False, decisions: bool = False,
                   listening: Callable[[str], None] = unheard) -> AsyncGenerator[Tapped, None]:
    """A Dynamo event plane: `kv-events` envelopes on NATS Core in the scope's components and endpoints (and with
    `decisions`, the routers' `active_sequences_events`, in the order the server delivers them), or kvctl's
    JetStream stream's JSON (new messages only, through an ephemeral consumer: tailing never moves a router's
    place).

    `listening` is told once the server has the subscription: nothing published after that is missed."""

    nc = await _connect_unless_stopped(conn, stop)
    queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
    topics = (KV_EVENTS, ACTIVE_SEQUENCES) if decisions else (KV_EVENTS,)
    if decisions:
        stats.decisions = 0

    async def on(msg: Msg) -> None:
        where = scope.match(msg.subject)
        if jetstream:
            queue.put_nowait((KV_EVENTS, msg.data))
        elif where is not None and where[2] in topics:
            queue.put_nowait((where[2], msg.data))

    sequences: dict[WorkerKey, Numbering] = {}
    try:
        if jetstream:
            from nats.js.api import DeliverPolicy

            names = scope.names()
            await nc.jetstream().subscribe(names.stream_subject, cb=on, ordered_consumer=True,
                                           deliver_policy=DeliverPolicy.NEW)
            listening(f"listening on stream {names.stream} ({names.stream_subject}) at {conn.shown_url}")
        else:
            await nc.subscribe(scope.subscription, cb=on)
            await barrier(nc)
            listening(f"listening on {' and '.join(map(scope.pattern, topics))} at {conn.shown_url}")
        while not stop():
            try:
                topic, data = await asyncio.wait_for(queue.get(), POLL_MS / 1000)
            except TimeoutError:
                continue
            for tapped in (tapped_events(_durable, data, sequences, stats) if jetstream
                           else plane_message(data, topic, sequences, stats)):
                yield tapped
    finally:
        await nc.close()


def _durable(data: bytes) -> Decoded:
    """A message of kvctl's JetStream stream: one event as JSON."""
    return [decode_router_event_json(data)], []


async def _connect_unless_stopped(conn: NatsConnection, stop: Callable[[], bool]) -> nats.NATS:
    """The tap's connection. A server that accepts but never speaks takes two connect timeouts to fail; a stop
    meanwhile (--duration, a signal) ends the attempt, as a failure: the server was not reached."""
    connecting = asyncio.ensure_future(connect(conn, reconnect=FOLLOW))
    while not (await asyncio.wait({connecting}, timeout=POLL_MS / 1000))[0]:
        if stop():
            connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await connecting
            raise unreachable(conn, "not connected when told to stop")
    return connecting.result()
