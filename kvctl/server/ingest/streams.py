"""The running engine streams of a router: started when a worker with an endpoint is registered (flag or
`POST /v1/workers`), stopped when it is removed, reported by `GET /v1/status`.

A stream that dies of an exception (a socket it cannot open: out of file descriptors, say) is not left
stopped behind a normal-looking status: it shows as `failed` with its error while it waits, and is run
again after a backoff that doubles from `RESTART_MIN_S` to `RESTART_MAX_S`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq.asyncio

from kvctl.core.events import Cleared, EventData
from kvctl.core.names import SeqMark, WorkerKey, format_worker, selects
from kvctl.core.words import counted
from kvctl.runtime import BurstTrimmer
from kvctl.server.budget import SLICE_S
from kvctl.server.ingest.decode_process.parent import Decoder, InlineDecoder
from kvctl.server.ingest.zmq_source import EngineStream
from kvctl.server.logs import error_text
from kvctl.server.state import Fleet
from kvctl.server.worker_info import WorkerInfo
from kvctl.zmq_limits import MAX_MESSAGE_BYTES

log = logging.getLogger("kvctl.serve")
_NOBODY: WorkerKey = (0, 0)  # the worker of an empty batch (a marker): applying it touches nothing


RESTART_MIN_S = 0.5
RESTART_MAX_S = 30.0
"""Backoff between the runs of a stream that died: doubling from the first to the second."""

QUEUE_BATCHES = 10_000
"""Decoded batches a model's writer may fall behind by before sources start dropping (and counting)."""

SLICE_EVENTS = 64
"""Events of one batch applied between two looks at the clock (as bulk loads do: far under a slice even for long
chains): a batch larger than this is applied a slice of the loop at a time (one message of 100,000 events held the
loop for 0.57 s in one step)."""


TOO_LARGE_FIX = ("raise --max-zmq-message-bytes if the sender's batches are that large, else fix the sender; "
                 "what it sent meanwhile is a gap, replayed or counted lost")

_Item = tuple[WorkerKey, list[EventData], SeqMark | None, Callable[[], None] | None]
"""A queued batch: its worker, events, engine stream and seq, and what to call once it is applied."""


class ModelWriter:
    """The one task that applies a model's engine events: sources only decode and enqueue, so a slow
    apply never stalls a socket, and batches keep their arrival order. A full queue drops and counts.

    Engine streams do not get that far: once the queue and the batches still being decoded (which
    will land in it) fill half the queue (`full`), they stop reading until that is down to a quarter
    (`room`), so a burst waits in ZMQ, and what ZMQ drops comes back as a gap the engine replays.

    A batch of more than `SLICE_EVENTS` events is applied in slices, in order, the loop let run between them;
    nothing else of its model's queue comes in between, and whatever else would change its worker's index
    meanwhile (a bulk load, a reset, the worker's removal) applies the rest of it first (`Fleet.unfinished`),
    so the batch stays whole whatever comes when.
    """

    def __init__(self, fleet: Fleet, model: str, maxsize: int = QUEUE_BATCHES, decoder: Decoder | None = None
                 ) -> None:
        self.fleet = fleet
        self.model = model
        self.queue: asyncio.Queue[_Item] = asyncio.Queue(maxsize)
        self.dropped_batches = 0
        self.dropped_events = 0
        self._decoder: Decoder = InlineDecoder() if decoder is None else decoder
        self.high = max(1, maxsize // 2)
        self._low = maxsize // 4
        self._has_room = asyncio.Event()
        self._trimmer = BurstTrimmer()
        self.slicing = False  # a batch is being applied in slices
        self.queued = _QueueAlone(self)
        self.task = asyncio.get_running_loop().create_task(self._drain())

    def _backlog(self) -> int:
        return self.queue.qsize() + self._decoder.in_flight

    @property
    def full(self) -> bool:
        return self._backlog() >= self.high

    async def room(self) -> None:
        await self.room_below(self._backlog)

    async def room_below(self, size: Callable[[], int]) -> None:
        while size() > self._low and not self.task.done():
            self._has_room.clear()
            await self._has_room.wait()

    def put(self, worker: WorkerKey, events: list[EventData], mark: SeqMark | None = None) -> bool:
        """Queue a batch (from the engine stream and seq `mark`); False when the queue was full and it was
        dropped (and counted)."""
        try:
            self.queue.put_nowait((worker, events, mark, None))
        except asyncio.QueueFull:
            self.dropped_batches += 1
            self.dropped_events += len(events)
            return False
        return True

    async def put_wait(self, worker: WorkerKey, events: list[EventData]) -> None:
        """Queue a batch, waiting for room: for durable sources, which must not drop."""
        await self.queue.put((worker, events, None, None))

    async def applied(self) -> None:
        """Return once everything queued so far is in the index."""
        done = asyncio.Event()
        await self.queue.put((_NOBODY, [], None, done.set))
        await done.wait()

    async def _drain(self) -> None:
        queue = self.queue
        while True:
            item = await queue.get()
            applied = 0
            end = time.perf_counter() + SLICE_S
            while True:  # apply what is there, a slice of the loop at a time
                if len(item[1]) > SLICE_EVENTS:
                    end = await self._sliced(*item, end)
                else:
                    self._apply(*item)
                applied += 1
                if queue.empty():
                    break
                if queue.qsize() <= self._low:  # waiters check their own measure (see room_below)
                    self._has_room.set()
                if time.perf_counter() > end:
                    await asyncio.sleep(0)
                    end = time.perf_counter() + SLICE_S
                item = queue.get_nowait()
            self._has_room.set()
            self._trimmer.applied(applied)
            if not self._decoder.in_flight:
                self._trimmer.idle()

    def _apply(self, worker: WorkerKey, events: list[EventData], mark: SeqMark | None,
               on_applied: Callable[[], None] | None) -> None:
        self.fleet.apply_engine_batch(self.model, worker, events, time.monotonic(), mark)
        if on_applied is not None:
            on_applied()

    async def _sliced(self, worker: WorkerKey, events: list[EventData], mark: SeqMark | None,
                      on_applied: Callable[[], None] | None, end: float) -> float:
        """A large batch applied `SLICE_EVENTS` at a time, the loop let run whenever a slice of it is spent (from
        `end` on); its `mark` goes with its last events. Returns when the current slice of the loop ends."""
        fleet, key, done = self.fleet, (self.model, worker), 0

        def rest() -> None:  # the rest of the batch at once: before another change to the worker, or on a cancel
            nonlocal done
            if done < len(events):
                fleet.apply_engine_batch(self.model, worker, events[done:], time.monotonic(), mark)
                done = len(events)

        fleet.unfinished[key] = rest
        self.slicing = True
        try:
            while done < len(events):
                if time.perf_counter() > end:
                    await asyncio.sleep(0)
                    end = time.perf_counter() + SLICE_S
                    continue  # what ran meanwhile may have applied the rest
                upto = min(done + SLICE_EVENTS, len(events))
                fleet.apply_engine_batch(self.model, worker, events[done:upto], time.monotonic(),
                                         mark if upto == len(events) else None)
                done = upto
        finally:
            rest()
            if fleet.unfinished.get(key) is rest:
                del fleet.unfinished[key]
            self.slicing = False
        if on_applied is not None:
            on_applied()
        return end

    async def flush(self) -> None:
        while not self.queue.empty() and not self.task.done():  # a dead writer drains nothing: do not spin
            await asyncio.sleep(0)

    def status(self) -> dict[str, Any]:
        return {"model": self.model, "queued": self.queue.qsize(), "capacity": self.queue.maxsize,
                "dropped_batches": self.dropped_batches, "dropped_events": self.dropped_events}


class _QueueAlone:
    """A writer's queue without the batches still being decoded, as backpressure: what the decode
    process's answers wait on, since the batches in flight there can only land once they are read."""

    def __init__(self, writer: ModelWriter) -> None:
        self._writer = writer

    @property
    def full(self) -> bool:
        return self._writer.queue.qsize() >= self._writer.high

    async def room(self) -> None:
        await self._writer.room_below(self._writer.queue.qsize)


@dataclasses.dataclass(slots=True)
class _Source:
    """A stream and the task that runs it (again, after a failure), with how it failed."""

    stream: EngineStream
    task: asyncio.Task[None] | None = None
    failures: int = 0
    last_error: str | None = None
    failed: bool = False  # died, waiting for its next run

    def row(self) -> dict[str, Any]:
        return {"state": "failed" if self.failed else "running", "failures": self.failures,
                "last_error": self.last_error}


class Streams:
    """`decoder` is shared by every stream, so batches reach the writers in the order they came in; `context`
    is the ZMQ context their sockets are made in (the process-wide one by default). At most `max_engines`
    streams run at once: past it an engine is refused (`admit`), and counted, never accepted and dropped."""

    def __init__(self, fleet: Fleet, *, queue_batches: int = QUEUE_BATCHES, decoder: Decoder | None = None,
                 context: zmq.asyncio.Context | None = None, restart_min_s: float = RESTART_MIN_S,
                 max_engines: int | None = None, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.fleet = fleet
        self.max_engines = max_engines
        self.max_message_bytes = max_message_bytes
        self.refused = 0  # engines refused for want of room
        self.queue_batches = queue_batches
        self.decoder: Decoder = InlineDecoder() if decoder is None else decoder
        self.context = context
        self.restart_min_s = restart_min_s
        self._running: dict[WorkerKey, _Source] = {}
        self.writers: dict[str, ModelWriter] = {}
        self._rates: dict[WorkerKey, float] = {}  # events/s over the last sampling interval
        self._last_sample: dict[WorkerKey, tuple[float, int]] = {}

    def writer(self, model: str) -> ModelWriter:
        writer = self.writers.get(model)
        if writer is None:
            writer = self.writers[model] = ModelWriter(self.fleet, model, self.queue_batches, self.decoder)
        return writer

    def admit(self, info: WorkerInfo) -> bool:
        """Whether `start(info)` would not go past `max_engines` (a worker already followed, or without an
        endpoint, takes no more room); a refusal is counted."""
        if (not info.endpoint or info.key in self._running or self.max_engines is None
                or len(self._running) < self.max_engines):
            return True
        self.refused += 1
        return False

    def start(self, info: WorkerInfo) -> bool:
        """Subscribe to a worker's engine; False when it has no endpoint, is already subscribed, or there is no
        room left (see `admit`: logged and counted)."""
        if not info.endpoint or info.key in self._running:
            return False
        if not self.admit(info):
            assert self.max_engines is not None  # only a limit refuses
            log.error("engine %s at %s not followed: %s already (--max-engines)", format_worker(info.key),
                      info.endpoint, counted(self.max_engines, "engine"))
            return False
        model = info.model
        writer = self.writer(model)

        def on_restart(worker: WorkerKey) -> None:
            log.warning("engine %s restarted (its seq went back): clearing its blocks", format_worker(worker))
            writer.put(worker, [Cleared()])  # in order with the batches already queued

        stream = EngineStream(worker=info.key, endpoint=info.endpoint, replay_endpoint=info.replay_endpoint,
                              topic=info.topic, block_size=self.fleet.model(model).block_size, sink=writer.put,
                              on_restart=on_restart, decoder=self.decoder, downstream=writer, queue=writer.queued,
                              context=self.context, resume_seq=self.fleet.stream_seqs.get((info.key, info.endpoint)),
                              max_message_bytes=self.max_message_bytes, on_dropped=lambda: self._dropped(info))
        source = self._running[info.key] = _Source(stream)
        source.task = asyncio.get_running_loop().create_task(self._run(source))
        return True

    def _dropped(self, info: WorkerInfo) -> None:
        """libzmq dropped an engine's connection for a message over the limit (it is made again): counted, the
        first time logged."""
        engine = f"engine {format_worker(info.key)} at {info.endpoint}"
        if ("zmq", "too_large") not in self.fleet.health.losses:
            log.warning("%s sent a message over %s bytes (--max-zmq-message-bytes): its connection was dropped and "
                        "made again; further ones are counted in /v1/status health", engine,
                        f"{self.max_message_bytes:,}")
        self.fleet.health.lose("zmq", "too_large", detail=f"{engine}: a message over {self.max_message_bytes:,} "
                               "bytes (or a malformed ZMTP frame); its connection was dropped and made again",
                               fix=TOO_LARGE_FIX)

    async def _run(self, source: _Source) -> None:
        """Run the stream until it is closed; one that dies is shown failed and run again after a backoff."""
        stream, delay = source.stream, self.restart_min_s
        while True:
            try:
                await stream.run()
                return  # closed
            except Exception as exc:  # a stream must never take the daemon down, nor stop unseen
                source.failures += 1
                source.last_error = error_text(exc)
                source.failed = True
                log.exception("engine stream %s failed; running it again in %.1fs", stream.endpoint, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RESTART_MAX_S)
            source.failed = False

    async def stop(self, worker_id: int, dp_rank: int | None = None) -> int:
        """Stop a worker's streams; returns once what they had received is in the index."""
        keys = [k for k in self._running if selects((worker_id, dp_rank), k)]
        for key in keys:
            source = self._running.pop(key)
            self._rates.pop(key, None)
            self._last_sample.pop(key, None)
            source.stream.close()  # cancels its task, in a run or in a backoff
            assert source.task is not None
            with contextlib.suppress(asyncio.CancelledError):
                await source.task
            source.stream.gap_log.close()
        if keys:
            await self.decoder.drained()
            for writer in self.writers.values():
                if not writer.task.done():
                    await writer.applied()
        return len(keys)

    async def close(self) -> None:
        """Stop the sources, then let the writers apply what was already received."""
        for worker_id, dp_rank in list(self._running):
            await self.stop(worker_id, dp_rank)
        await self.decoder.close()
        for writer in self.writers.values():
            await writer.flush()
            writer.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer.task

    def idle(self) -> bool:
        """Nothing received is waiting to be decoded or applied, and the decode process has been quiet."""
        return self.decoder.idle() and all(w.queue.empty() and not w.slicing for w in self.writers.values())

    def engines(self) -> dict[str, Any]:
        """How many engines are followed, the most that may be, and how many were refused."""
        return {"running": len(self._running), "max": self.max_engines, "refused": self.refused}

    def queues(self) -> list[dict[str, Any]]:
        return [w.status() for _, w in sorted(self.writers.items())]

    def sample(self, now: float) -> None:
        """Turn each stream's event counter into a rate over the time since the previous sample."""
        for key, source in self._running.items():
            events = source.stream.stats.events
            previous = self._last_sample.get(key)
            if previous is not None and now > previous[0]:
                self._rates[key] = (events - previous[1]) / (now - previous[0])
            self._last_sample[key] = (now, events)

    def log_gaps(self) -> None:
        """The summary line of each stream whose lost gaps are due one (see `kvctl.server.ingest.gap_log`): a stream
        that stops losing still has its last losses logged, not only at its next loss."""
        for source in self._running.values():
            source.stream.gap_log.flush()

    def drops(self) -> dict[WorkerKey, dict[str, Any]]:
        """Each stream's KV cache groups, salts seen and events dropped (what `status` shows of them), by the
        (worker, dp rank) it follows: `GET /v1/workers` joins them to the worker rows."""
        return {key: source.stream.drops.status() for key, source in self._running.items()}

    def status(self) -> list[dict[str, Any]]:
        out = []
        for (worker_id, dp_rank), source in sorted(self._running.items()):
            stats = dataclasses.asdict(source.stream.stats) | source.row() | source.stream.drops.status()
            stats["worker"] = {"worker_id": worker_id, "dp_rank": dp_rank}
            stats["schema"] = {k: sorted(v) for k, v in stats["schema"].items()}
            stats["last_event_age_s"] = None if stats["last_event_at"] is None else round(
                time.monotonic() - stats["last_event_at"], 3)
            stats["events_per_s"] = round(self._rates.get((worker_id, dp_rank), 0.0), 1)
            out.append(stats)
        return out
