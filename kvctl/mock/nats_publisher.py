"""A mock engine on a Dynamo NATS event plane (`--format dynamo-nats`), publishing what a Dynamo 1.6.1
worker publishes: `kv-events` (an array of RouterEvents), `kv_metrics` (its KV usage) and, every
FORWARD_PASS_S, `forward-pass-metrics` (running and waiting requests), each topic under
`namespace.{ns}.component.{comp}.endpoint.{ep}` in the envelope with a publisher id of its own.

Block hashes are the engine's own; tokens hashes are Dynamo's local hashes of the block's tokens, as
Dynamo's publisher computes them. Event ids count from 1 and envelope sequences from 0; both start over
when the engine restarts. Messages leave in order through one sender task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import nats

from kvctl.core.events import Cleared, EventData, Removed, RouterEvent, Stored
from kvctl.core.events.dynamo import EnvelopeWriter, encode_router_event_batch
from kvctl.core.events.plane import (
    FORWARD_PASS,
    KV_EVENTS,
    KV_METRICS,
    ActiveLoad,
    ForwardPass,
    PlaneNames,
    RequestCounts,
    encode_active_load,
    encode_forward_pass,
)
from kvctl.core.hashing import local_block_hashes
from kvctl.mock.cache import CacheCleared, CacheEvent, CacheStored
from kvctl.nats.connection import NatsConnection, Reconnect, connect

log = logging.getLogger("kvctl.mock")
FORWARD_PASS_S = 1.0
RECONNECT = Reconnect(first_s=0.5, max_s=0.5)
"""An engine whose NATS server restarts publishes again as soon as it is back: a try every 0.5 s."""


@dataclass(frozen=True, slots=True)
class EngineGauges:
    """What the engine reports besides its events, read when a report goes out."""

    used_blocks: Callable[[], int]
    running: Callable[[], int]
    waiting: Callable[[], int]


class NatsEventPublisher:
    def __init__(self, conn: NatsConnection, names: PlaneNames, worker_id: int, dp_rank: int, block_size: int,
                 gauges: EngineGauges) -> None:
        self.conn = conn
        self.names = names
        self.worker_id, self.dp_rank, self.block_size = worker_id, dp_rank, block_size
        self.gauges = gauges
        self.next_id = 1
        self.passes = 0
        ids = random.Random(f"{worker_id}:{dp_rank}")  # stable per engine: a restart keeps them, as the mock's
        self._writers = {topic: EnvelopeWriter(ids.getrandbits(53), topic)  # restart keeps its ports too
                         for topic in (KV_EVENTS, KV_METRICS, FORWARD_PASS)}
        self._queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
        self._nc: nats.NATS | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Connected, or `Unreachable` (the mock exits 3 with one line)."""
        self._nc = await connect(self.conn, reconnect=RECONNECT, on_error=self._error)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._send()), loop.create_task(self._report_passes())]

    async def _error(self, exc: Exception) -> None:
        log.warning("engine %d: NATS at %s: %s", self.worker_id, self.conn.shown_url, exc or type(exc).__name__)

    def publish(self, changes: Sequence[CacheEvent]) -> None:
        events = []
        for change in changes:
            if isinstance(change, CacheStored):
                local = local_block_hashes(change.tokens, self.block_size)
                data: EventData = Stored(change.parent, list(change.hashes), local, change.tier)
            elif isinstance(change, CacheCleared):
                data = Cleared()
            else:
                data = Removed(list(change.hashes), change.tier)
            events.append(RouterEvent(self.worker_id, data, self.dp_rank, self.next_id))
            self.next_id += 1
        self._put(KV_EVENTS, encode_router_event_batch(events))
        load = ActiveLoad(self.worker_id, self.dp_rank, None, None, self.gauges.used_blocks())
        self._put(KV_METRICS, encode_active_load(load))

    def reset(self) -> None:
        """An engine restart: ids and sequences start over (the router clears what it held for this worker)."""
        self.next_id = 1
        for writer in self._writers.values():
            writer.restart()

    def _put(self, topic: str, payload: bytes) -> None:
        body = self._writers[topic].wrap(payload, int(time.time() * 1000))
        self._queue.put_nowait((self.names.subject(topic), body))

    async def _report_passes(self) -> None:
        """A heartbeat of forward passes: an idle Dynamo worker keeps reporting too."""
        while True:
            self.passes += 1
            report = ForwardPass(self.worker_id, self.dp_rank, self.passes, 0.0,
                                 scheduled=RequestCounts(decode_requests=self.gauges.running(), prefill_kv_tokens=0),
                                 queued=RequestCounts(prefill_requests=self.gauges.waiting()))
            self._put(FORWARD_PASS, encode_forward_pass(report))
            await asyncio.sleep(FORWARD_PASS_S)

    async def _send(self) -> None:
        assert self._nc is not None
        while True:
            subject, body = await self._queue.get()
            await self._nc.publish(subject, body)

    async def close(self) -> None:
        if self._tasks:
            self._tasks[1].cancel()
        while not self._queue.empty() and self._tasks and not self._tasks[0].done():
            await asyncio.sleep(0.01)  # what was queued goes out before the connection closes
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._nc is not None:
            await self._nc.close()
