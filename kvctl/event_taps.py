"""Listening to KV events without a router: an engine's ZMQ PUB socket, or a Dynamo NATS event plane.

What `kvctl events tail` and `events record` read. Each message is decoded as the router would; what
arrives is yielded as `Tapped` (a decoded event, or a gap in the sequence), and `TapStats` keeps the
counts the command prints on exit: the answer to "are events arriving at all, and whole?".
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq

from kvctl.core.events import RouterEvent
from kvctl.core.events.dynamo import decode_envelope, decode_router_event_batch, decode_router_event_json
from kvctl.core.events.engine import decode_engine_message
from kvctl.core.events.errors import DecodeError
from kvctl.core.events.plane import KV_EVENTS, PlaneScope
from kvctl.errors import Unreachable
from kvctl.nats_barrier import barrier
from kvctl.natsconn import UNREACHABLE_HINT, NatsConnection, connect

if TYPE_CHECKING:
    import nats

POLL_MS = 200


@dataclass(frozen=True, slots=True)
class Tapped:
    received_ms: int
    seq: int | None  # the engine's batch seq (ZMQ) or the event id (NATS)
    event: RouterEvent | None  # None: a gap
    missing: tuple[int, int] | None = None  # first and last seq (or id) that never came


@dataclass
class TapStats:
    messages: int = 0
    events: int = 0
    gaps: int = 0
    missing: int = 0
    decode_errors: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, object]:
        return {"messages": self.messages, "events": self.events, "gaps": self.gaps, "missing": self.missing,
                "decode_errors": dict(self.decode_errors)}


def _now_ms() -> int:
    return int(time.time() * 1000)


def _unheard(_: str) -> None:
    pass


def tap_zmq(endpoint: str, *, stop: Callable[[], bool], stats: TapStats, topic: str = "", worker_id: int = 0,
            block_size: int | None = None, listening: Callable[[str], None] = _unheard) -> Iterator[Tapped]:
    """An engine's live batches, as RouterEvents of `worker_id` (engines do not say who they are).

    `listening` is told once the SUB socket is connecting; ZMQ joins in the background, so an engine's
    first messages can still be missed (its PUB drops what it sends before the join completes)."""
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sub.connect(endpoint)
    listening(f"subscribed to {endpoint}" + (f" (topic {topic!r})" if topic else ""))
    last: int | None = None
    try:
        while not stop():
            if not sub.poll(POLL_MS):
                continue
            frames = sub.recv_multipart()
            stats.messages += 1
            try:
                message = decode_engine_message(frames, default_block_size=block_size)
            except DecodeError as exc:
                stats.decode_errors[exc.kind.value] += 1
                continue
            if last is not None and message.seq > last + 1:
                stats.gaps += 1
                stats.missing += message.seq - last - 1
                yield Tapped(_now_ms(), message.seq, None, (last + 1, message.seq - 1))
            last = message.seq
            for error in message.batch.errors:
                stats.decode_errors[error.kind.value] += 1
            for n, data in enumerate(message.batch.events):
                stats.events += 1
                yield Tapped(_now_ms(), message.seq, RouterEvent(worker_id, data, message.batch.dp_rank, n))
    finally:
        sub.close(0)


async def tap_nats(conn: NatsConnection, scope: PlaneScope, *, stop: Callable[[], bool], stats: TapStats,
                   jetstream: bool = False, listening: Callable[[str], None] = _unheard) -> AsyncIterator[Tapped]:
    """A Dynamo event plane: `kv-events` envelopes on NATS Core in the scope's components and endpoints, or
    kvctl's JetStream stream's JSON (new messages only, through an ephemeral consumer: tailing never moves
    a router's place).

    `listening` is told once the server has the subscription: nothing published after that is missed."""

    nc = await _connect_unless_stopped(conn, stop)
    queue: asyncio.Queue[bytes] = asyncio.Queue()

    async def on(msg: nats.aio.msg.Msg) -> None:
        where = scope.match(msg.subject)
        if jetstream or (where is not None and where[2] == KV_EVENTS):
            queue.put_nowait(msg.data)

    last: dict[tuple[int, int], int] = {}
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
            listening(f"listening on {scope.pattern(KV_EVENTS)} at {conn.shown_url}")
        while not stop():
            try:
                data = await asyncio.wait_for(queue.get(), POLL_MS / 1000)
            except TimeoutError:
                continue
            stats.messages += 1
            try:
                events, errors = (([decode_router_event_json(data)], []) if jetstream
                                  else decode_router_event_batch(decode_envelope(data).payload))
            except DecodeError as exc:
                stats.decode_errors[exc.kind.value] += 1
                continue
            for error in errors:
                stats.decode_errors[error.kind.value] += 1
            for event in events:
                key = (event.worker_id, event.dp_rank)
                previous = last.get(key)
                if previous is not None and event.event_id > previous + 1:
                    stats.gaps += 1
                    stats.missing += event.event_id - previous - 1
                    yield Tapped(_now_ms(), event.event_id, None, (previous + 1, event.event_id - 1))
                last[key] = event.event_id
                stats.events += 1
                yield Tapped(_now_ms(), event.event_id, event)
    finally:
        await nc.close()


async def _connect_unless_stopped(conn: NatsConnection, stop: Callable[[], bool]) -> nats.NATS:
    """The tap's connection. A server that accepts but never speaks takes two connect timeouts to fail; a stop
    meanwhile (--duration, a signal) ends the attempt, as a failure: the server was not reached."""
    connecting = asyncio.ensure_future(connect(conn, follow=True))
    while not (await asyncio.wait({connecting}, timeout=POLL_MS / 1000))[0]:
        if stop():
            connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await connecting
            raise Unreachable(f"cannot reach NATS at {conn.shown_url}: not connected when told to stop",
                              hint=UNREACHABLE_HINT)
    return connecting.result()
