"""A mock engine's KV events the way a Dynamo worker publishes them: RouterEvents in the event-plane
envelope on NATS Core (`--format dynamo-nats`).

Block hashes are the engine's own; tokens hashes are Dynamo's local hashes of the block's tokens, as
Dynamo's publisher computes them. Event ids and envelope sequence numbers count from 1 and start over
when the engine restarts. Events leave in order through one sender task.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

import nats

from kvctl.core.events import Removed, RouterEvent, Stored
from kvctl.core.events.dynamo import EventEnvelope, encode_envelope, encode_router_event_msgpack
from kvctl.core.events.plane import PlaneNames
from kvctl.core.hashing import local_block_hashes
from kvctl.mock.cache import CacheEvent, CacheStored


class NatsEventPublisher:
    def __init__(self, url: str, names: PlaneNames, worker_id: int, dp_rank: int, block_size: int) -> None:
        self.url = url
        self.names = names
        self.worker_id, self.dp_rank, self.block_size = worker_id, dp_rank, block_size
        self.next_id = 1
        self._queue: asyncio.Queue[bytes] = asyncio.Queue()
        self._nc: nats.NATS | None = None
        self._sender: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._nc = await nats.connect(self.url, max_reconnect_attempts=-1, reconnect_time_wait=0.5)
        self._sender = asyncio.get_running_loop().create_task(self._send())

    def publish(self, changes: Sequence[CacheEvent]) -> None:
        for change in changes:
            if isinstance(change, CacheStored):
                local = local_block_hashes(change.tokens, self.block_size)
                data: Stored | Removed = Stored(change.parent, list(change.hashes), local, change.tier)
            else:
                data = Removed(list(change.hashes), change.tier)
            event = RouterEvent(self.worker_id, data, self.dp_rank, self.next_id)
            envelope = EventEnvelope(self.worker_id, self.next_id, int(time.time() * 1000), "kv-events",
                                     encode_router_event_msgpack(event))
            self.next_id += 1
            self._queue.put_nowait(encode_envelope(envelope))

    def reset(self) -> None:
        """An engine restart: ids start over (the router clears what it held for this worker)."""
        self.next_id = 1

    async def _send(self) -> None:
        assert self._nc is not None
        while True:
            await self._nc.publish(self.names.kv_events, await self._queue.get())

    async def close(self) -> None:
        while not self._queue.empty() and self._sender is not None and not self._sender.done():
            await asyncio.sleep(0.01)  # what was queued goes out before the connection closes
        if self._sender is not None:
            self._sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sender
        if self._nc is not None:
            await self._nc.close()
