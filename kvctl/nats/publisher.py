"""Publishing RouterEvents onto a Dynamo event plane, as its workers do (`kvctl events publish`).

NATS Core: each event as a one-event `kv-events` array in the msgpack envelope, sequence numbers from 0,
on `namespace.{ns}.component.{comp}.endpoint.{ep}.kv-events`, as Dynamo 1.6.1 does. JetStream:
RouterEvent JSON on `{stream}.kv-events`, each acknowledged by the server (a stream that is not there
is created with Dynamo's settings first, as a worker would).
"""

from __future__ import annotations

import asyncio
import time

import nats

from kvctl.core.events import RouterEvent
from kvctl.core.events.dynamo import EnvelopeWriter, encode_router_event_batch, encode_router_event_json
from kvctl.core.events.plane import KV_EVENTS, PlaneNames
from kvctl.errors import KvctlError
from kvctl.nats.barrier import barrier
from kvctl.nats.connection import NatsConnection, connect
from kvctl.nats.jetstream import ensure_stream

ACK_WINDOW = 256  # JetStream publishes in flight at once


def publish(conn: NatsConnection, names: PlaneNames, events: list[RouterEvent], *, jetstream: bool,
            publisher_id: int) -> int:
    """Publish every event, in order; returns how many went out. Raises Unreachable when NATS is not there."""
    return asyncio.run(_publish(conn, names, events, jetstream, publisher_id))


async def _publish(conn: NatsConnection, names: PlaneNames, events: list[RouterEvent], jetstream: bool,
                   publisher_id: int) -> int:
    nc = await connect(conn)
    try:
        if jetstream:
            await _publish_jetstream(nc, names, events)
        else:
            writer = EnvelopeWriter(publisher_id, KV_EVENTS)
            for ev in events:
                await nc.publish(names.kv_events, writer.wrap(encode_router_event_batch([ev]), int(time.time() * 1000)))
            await barrier(nc)
    finally:
        await nc.close()
    return len(events)


async def _publish_jetstream(nc: nats.NATS, names: PlaneNames, events: list[RouterEvent]) -> None:
    js = nc.jetstream()
    await ensure_stream(js, names.stream)
    for start in range(0, len(events), ACK_WINDOW):  # in order: a window is acked before the next goes
        window = events[start:start + ACK_WINDOW]
        try:
            await asyncio.gather(*(js.publish(names.stream_subject, encode_router_event_json(ev)) for ev in window))
        except nats.errors.Error as exc:
            raise KvctlError(f"JetStream refused event {start}..{start + len(window) - 1}: {exc}") from None
