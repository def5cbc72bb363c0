"""kvctl's JetStream layout on a server: the stream of RouterEvent JSON, and the snapshot object a durable
router leaves beside it, as the router, `events publish` and `kvctl tree` all find them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvctl.core.events import RouterEvent
from kvctl.core.events.dump_file import DumpFileError, read_router_events
from kvctl.core.events.plane import RADIX_STATE_OBJECT, PlaneNames
from kvctl.errors import KvctlError, NotFound
from kvctl.nats.connection import NatsConnection, connect

if TYPE_CHECKING:
    from nats.js import JetStreamContext

STREAM_MAX_AGE_S = 3600.0  # Dynamo's default retention (DYN_NATS_STREAM_MAX_AGE)


async def ensure_stream(js: JetStreamContext, stream: str) -> None:
    """The stream, created with Dynamo's settings when it is not there yet (as a worker would)."""
    import nats.js.errors
    from nats.js.api import StreamConfig

    try:
        await js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.*"], max_age=STREAM_MAX_AGE_S))


async def radix_state(js: JetStreamContext, bucket: str) -> bytes | None:
    """The snapshot object of `bucket` (RouterEvent JSON lines); None when the bucket or the object is not there."""
    import nats.js.errors

    try:
        store = await js.object_store(bucket)
        return (await store.get(RADIX_STATE_OBJECT)).data or b""
    except (nats.js.errors.NotFoundError, nats.js.errors.BucketNotFoundError, nats.js.errors.ObjectNotFoundError):
        return None


def snapshot_events(conn: NatsConnection, names: PlaneNames) -> list[RouterEvent]:
    """A durable router's snapshot as `kvctl tree` reads it: its events, or an error naming the object."""
    import asyncio

    data = asyncio.run(_read_snapshot(conn, names.bucket))
    if data is None:
        raise NotFound(f"no snapshot {names.bucket}/{RADIX_STATE_OBJECT} on {conn.shown_url}", status=404,
                       hint="a durable router writes one only once its stream passes --snapshot-threshold")
    try:
        return read_router_events(data.decode())
    except (DumpFileError, UnicodeDecodeError) as exc:
        raise KvctlError(f"{names.bucket}/{RADIX_STATE_OBJECT} on {conn.shown_url} is not a dump: {exc}") from None


async def _read_snapshot(conn: NatsConnection, bucket: str) -> bytes | None:
    nc = await connect(conn)
    try:
        return await radix_state(nc.jetstream(), bucket)
    finally:
        await nc.close()
