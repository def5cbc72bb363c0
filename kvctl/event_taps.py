"""Listening to KV events without a router: an engine's ZMQ PUB socket, or a Dynamo event plane (its default ZMQ
plane found through its discovery store here; NATS in `kvctl.nats.tap`).

What `kvctl events tail` and `events record` read. Each message is decoded as the router would, and its
seq (ZMQ) or event id (NATS, per worker) judged by the router's own rules (`Numbering`): what arrives is
yielded as `Tapped` (a decoded event, or a gap in the sequence), and `TapStats` keeps the counts the
command prints on exit: the answer to "are events arriving at all, and whole?". On a Dynamo plane, with
`decisions`, the routers' `active_sequences_events` (what replica sync publishes for each request routed) are
yielded too, in the order heard. A ZMQ tap refuses a frame over
`MAX_MESSAGE_BYTES`, as the router does (`kvctl.zmq_limits`): the connection libzmq drops for it is made again, and
counted in `decode_errors` as `too_large`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import zmq

from kvctl.core.events import RouterEvent
from kvctl.core.events.dynamo import decode_envelope, decode_router_event_batch
from kvctl.core.events.engine import decode_engine_message
from kvctl.core.events.errors import DecodeError
from kvctl.core.events.plane import ACTIVE_SEQUENCES, KV_EVENTS, ActiveSequenceEvent, PlaneScope, decode_sequence_events
from kvctl.core.events.publishers import Numbering, Order
from kvctl.core.events.zmq_wire import decode_zmq_message
from kvctl.core.names import WorkerKey
from kvctl.core.words import counted
from kvctl.errors import DiscoveryError, Unreachable
from kvctl.zmq_limits import MAX_MESSAGE_BYTES, WATCHED, Drops, limited, reconnect, waiting_events, watch

POLL_MS = 200
T = TypeVar("T")
E = TypeVar("E")


@dataclass(frozen=True, slots=True)
class Tapped:
    received_ms: int
    seq: int | None  # the engine's batch seq (ZMQ) or the event id (NATS)
    event: RouterEvent | None  # None: a gap, or a decision
    missing: tuple[int, int] | None = None  # first and last seq (or id) that never came
    decision: ActiveSequenceEvent | None = None  # a router's, heard on a Dynamo plane


@dataclass
class TapStats:
    messages: int = 0
    events: int = 0
    gaps: int = 0
    missing: int = 0
    restarts: int = 0  # the seq went back: the publisher started over
    repeats: int = 0  # the same seq again: skipped
    jumps: int = 0  # a seq implausibly far ahead: shown, not counted as missing
    decode_errors: Counter[str] = field(default_factory=Counter)
    publishers: int | None = None  # through a discovery store: how many it named (None: a tap of one address)
    decisions: int | None = None  # routers' decisions heard (None: not listened for)

    def as_dict(self) -> dict[str, object]:
        found = {} if self.publishers is None else {"publishers": self.publishers}
        heard = {} if self.decisions is None else {"decisions": self.decisions}
        return {"messages": self.messages, "events": self.events, "gaps": self.gaps, "missing": self.missing,
                "restarts": self.restarts, "repeats": self.repeats, "jumps": self.jumps,
                "decode_errors": dict(self.decode_errors), **found, **heard}

    def judge(self, sequence: Numbering, seq: int) -> tuple[Order, Tapped | None]:
        """Count where `seq` stands in `sequence`; with the marker of the gap before it when messages were lost."""
        last = sequence.last
        order = sequence.observe(seq)
        if order is Order.gap:
            assert last is not None
            self.gaps += 1
            self.missing += seq - last - 1
            return order, Tapped(_now_ms(), seq, None, (last + 1, seq - 1))
        if order is Order.restart:
            self.restarts += 1
        elif order is Order.repeat:
            self.repeats += 1
        elif order is Order.jump:
            self.jumps += 1
        return order, None


def _now_ms() -> int:
    return int(time.time() * 1000)


def unheard(_: str) -> None:
    pass


def tap_zmq(endpoint: str, *, stop: Callable[[], bool], stats: TapStats, topic: str = "", worker_id: int = 0,
            block_size: int | None = None, listening: Callable[[str], None] = unheard,
            max_bytes: int = MAX_MESSAGE_BYTES) -> Iterator[Tapped]:
    """An engine's live batches, as RouterEvents of `worker_id` (engines do not say who they are).

    `listening` is told once the SUB socket is connecting; ZMQ joins in the background, so an engine's
    first messages can still be missed (its PUB drops what it sends before the join completes)."""
    ctx = zmq.Context.instance()
    sub = limited(ctx.socket(zmq.SUB), max_bytes)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    monitor = sub.get_monitor_socket(WATCHED)
    sub.connect(endpoint)
    listening(f"subscribed to {endpoint}" + (f" (topic {topic!r})" if topic else ""))
    sequence = Numbering(once=True)
    poller, drops = zmq.Poller(), Drops[str]()
    poller.register(sub, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    try:
        while not stop():
            ready = dict(poller.poll(POLL_MS))
            for event, connection in waiting_events(monitor) if monitor in ready else ():
                drops.seen(event, connection, time.monotonic())
            for dropped in drops.due(time.monotonic()):
                reconnect(sub, dropped)
                stats.decode_errors["too_large"] += 1
            if sub not in ready:
                continue
            frames = sub.recv_multipart()
            stats.messages += 1
            try:
                message = decode_engine_message(frames, default_block_size=block_size)
            except DecodeError as exc:
                stats.decode_errors[exc.kind.value] += 1
                continue
            _, gap = stats.judge(sequence, message.seq)
            if gap is not None:
                yield gap
            for error in message.batch.errors:
                stats.decode_errors[error.kind.value] += 1
            for n, data in enumerate(message.batch.events):
                stats.events += 1
                yield Tapped(_now_ms(), message.seq, RouterEvent(worker_id, data, message.batch.dp_rank or 0, n))
    finally:
        sub.disable_monitor()
        monitor.close(0)
        sub.close(0)


Decoded = tuple[list[RouterEvent], list[DecodeError]]


def enveloped(data: bytes) -> Decoded:
    """A `kv-events` message of Dynamo's plane: the envelope around an array of events."""
    return decode_router_event_batch(decode_envelope(data).payload)


def _decoded(decode: Callable[[T], tuple[list[E], list[DecodeError]]], message: T, stats: TapStats) -> list[E]:
    """One message counted and decoded; what is bad counted by kind (all of it, when it does not decode at all)."""
    stats.messages += 1
    try:
        items, errors = decode(message)
    except DecodeError as exc:
        stats.decode_errors[exc.kind.value] += 1
        return []
    for error in errors:
        stats.decode_errors[error.kind.value] += 1
    return items


def tapped_events(decode: Callable[[T], Decoded], message: T, sequences: dict[WorkerKey, Numbering],
                  stats: TapStats) -> Iterator[Tapped]:
    """One message of a plane: counted, decoded (what is bad counted by kind), and its events, each preceded by
    the gap in its worker's event ids it follows, if any."""
    for event in _decoded(decode, message, stats):
        sequence = sequences.setdefault((event.worker_id, event.dp_rank), Numbering())
        _, gap = stats.judge(sequence, event.event_id)  # shown even when repeated: order is the envelope's
        if gap is not None:
            yield gap
        stats.events += 1
        yield Tapped(_now_ms(), event.event_id, event)


def _sequence_events(body: bytes) -> tuple[list[ActiveSequenceEvent], list[DecodeError]]:
    """An `active_sequences_events` message of Dynamo's plane: the envelope around one event or a batch."""
    return decode_sequence_events(decode_envelope(body).payload)


def plane_message(body: bytes, topic: str, sequences: dict[WorkerKey, Numbering], stats: TapStats
                  ) -> Iterator[Tapped]:
    """One enveloped message of a Dynamo plane, by its topic: KV events, or the routers' decisions (whose
    publishers' order is not judged: a decision lost shows as a request never freed)."""
    if topic == KV_EVENTS:
        yield from tapped_events(enveloped, body, sequences, stats)
        return
    for decision in _decoded(_sequence_events, body, stats):
        stats.decisions = (stats.decisions or 0) + 1
        yield Tapped(_now_ms(), None, None, decision=decision)


RELIST_S = 1.0
"""How often the ZMQ tap lists discovery again, to follow publishers that came since."""


async def tap_dynamo_zmq(discovery_url: str, scope: PlaneScope, *, stop: Callable[[], bool], stats: TapStats,
                         decisions: bool = False,
                         listening: Callable[[str], None] = unheard) -> AsyncGenerator[Tapped, None]:
    """A default Dynamo fleet's `kv-events` (and with `decisions`, its routers' `active_sequences_events`): every
    publisher in the scope's records in the discovery store, through one SUB socket connected to each (and to
    those that register later). Raises Unreachable when the store cannot be read at the start."""
    import zmq.asyncio

    from kvctl.core.events.discovery import namespace_prefix, parse_channel_key, parse_event_channel
    from kvctl.server.plane.dynamo_discovery import open_discovery

    store = open_discovery(discovery_url)
    ctx = zmq.asyncio.Context()
    sock = limited(ctx.socket(zmq.SUB), MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.LINGER, 0)
    topics = (KV_EVENTS, ACTIVE_SEQUENCES) if decisions else (KV_EVENTS,)
    for topic in topics:
        sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
    if decisions:
        stats.decisions = 0
    monitor = sock.get_monitor_socket(WATCHED)
    watching = asyncio.get_running_loop().create_task(watch(sock, monitor, lambda _: too_large()))
    followed: set[str] = set()

    def too_large() -> None:
        stats.decode_errors["too_large"] += 1

    async def follow() -> None:
        for key, value in (await store.list(namespace_prefix(scope.namespace))).items():
            try:
                channel = parse_event_channel(value)
                if parse_channel_key(key) != channel.key:
                    continue
            except DecodeError:
                continue
            if channel.topic in topics and scope.component in (None, channel.component) \
                    and scope.endpoint in (None, channel.endpoint) and channel.address not in followed:
                sock.connect(channel.address)
                followed.add(channel.address)
        stats.publishers = len(followed)

    sequences: dict[WorkerKey, Numbering] = {}
    try:
        try:
            await follow()
        except DiscoveryError as exc:
            raise Unreachable(f"cannot read discovery {discovery_url}: {exc}") from None
        listening(f"listening on {' and '.join(map(scope.pattern, topics))} through {discovery_url} "
                  f"({counted(len(followed), 'publisher')})")
        relisted = time.monotonic()
        while not stop():
            if time.monotonic() - relisted >= RELIST_S:
                with contextlib.suppress(DiscoveryError):  # a store briefly away: the sockets keep receiving
                    await follow()
                relisted = time.monotonic()
            if not await sock.poll(POLL_MS):
                continue
            try:
                message = decode_zmq_message(await sock.recv_multipart())
            except DecodeError as exc:
                stats.messages += 1
                stats.decode_errors[exc.kind.value] += 1
                continue
            for tapped in plane_message(message.envelope, message.topic, sequences, stats):
                yield tapped
    finally:
        watching.cancel()
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        ctx.term()
        await store.close()
