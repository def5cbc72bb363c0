"""Engine ZMQ ingestion (docs/contract.md, "Engine events on ZMQ"): one `EngineStream` per engine endpoint.

An engine (vLLM, SGLang) publishes `[topic, seq (u64 BE), payload]` on a PUB socket and may keep a
replay buffer behind a ROUTER socket. `EngineStream` subscribes, decodes each payload with the core
codec and hands the events to a sink, keeping them in the engine's seq order:

Live seqs are judged by the one set of sequence rules every source shares (`Numbering`,
kvctl/core/events/publishers.py):

- The first message sets the expected seq; history from before we connected is not asked for. A stream
  resumed after a router restart (`resume_seq`: the last seq its index holds, from the state dir) expects
  the next one instead, and asks the replay at once for everything after it, since the engine published
  while the router was down: what the engine no longer holds is counted lost; a replay that does not
  answer in time (the engine not up yet) leaves the stream waiting at its seq, and the first live message
  shows the gap, replayed like any other, or the engine's restart (its seq at or below the resumed one).
- `seq == last + 1` applies. A seq already applied via a replay is skipped and counted in `duplicates`.
- `seq > last + 1` is a gap. With a replay endpoint, the missing range is asked for on a DEALER
  (`[b"", start]`); until the replay ends, live messages are buffered so that a replayed store can
  never land after a newer live remove. Replayed batches apply strictly in seq order, then the
  buffer. Without a replay endpoint, on a timeout, or when the engine no longer holds the range,
  the missing batches are counted as lost, the stream is marked `gapped`, and it carries on.
- `seq` lower than the last live seq, or equal to it, is an engine restart: `on_restart` is called (the
  server clears that worker) and the stream continues from the new seq. The same seq again is no repeat
  here: a PUB numbers each batch once per process and ZMQ delivers each once (replays come on the
  DEALER), so it can only be an engine restarted after one batch. vLLM's publisher counts from 0 per
  process, so a first seq above 0 means its first batches went out before our SUB had reconnected:
  they are a gap from 0, replayed (or counted lost) like any other.
- A jump of more than `JUMP_MAX` seqs ahead is no plausible loss: it is counted in `jumps` and its
  batch applied, the stream keeping its place (no replay of 2^64 batches, no 2^64 lost batches).

Everything malformed is counted in `decode_errors` by `ErrorKind` and skipped; the stream never
stops on bad input. Only an error of its own (a socket it cannot open) or the sink or `on_restart` raising
ends `run()`; `kvctl.server.ingest.streams` then shows it failed and runs it again.

This module and the decode process (`kvctl.server.ingest.decode_process.child`, which may hold the SUB socket) are
the router's only ZMQ speakers; the decoding is `kvctl.core.events.engine`, which does no I/O.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import zmq
import zmq.asyncio

from kvctl.core.events import (
    TIER_VALUES,
    DecodeError,
    EngineBatch,
    ErrorKind,
    EventData,
    decode_replay_reply,
    decode_topic,
    encode_replay_request,
    live_seq,
)
from kvctl.core.events.publishers import Numbering, Order
from kvctl.core.names import SeqMark, StreamId, WorkerKey, format_worker
from kvctl.server.budget import SLICE_S
from kvctl.server.ingest.decode_process.parent import Backpressure, Decoder, InlineDecoder, NeverFull, Subscription
from kvctl.server.ingest.gap_log import GapLog
from kvctl.server.ingest.schema_seen import Schema, SchemaSeen, sampled
from kvctl.server.ingest.stream_drops import StreamDrops
from kvctl.server.ingest.stream_sockets import StreamSockets
from kvctl.server.ingest.stream_stats import StreamStats
from kvctl.zmq_limits import MAX_MESSAGE_BYTES

__all__ = ["EngineStream", "SchemaSeen", "StreamStats"]

log = logging.getLogger(__name__)

Sink = Callable[[WorkerKey, list[EventData], SeqMark | None], object]  # what it returns is not read
Received = list[bytes] | EngineBatch | ErrorKind
"""A live message as received: its frames when the stream read them itself, decoded when the decode process did."""
OnRestart = Callable[[WorkerKey], None]

@dataclass(slots=True)
class _Replay:
    """The replay in flight: the live messages that arrived meanwhile, and when to give up."""

    start: int
    deadline: float
    buffered: deque[tuple[int, Received]] = field(default_factory=deque)
    lost_before: int = 0  # the stream's lost_batches when the replay began
    catch_up: bool = False  # asked at a resumed stream's start, before any live message showed a gap


class EngineStream:
    """Subscribe to one engine endpoint and feed its events, in seq order, to `sink`.

    `worker` is the registered `(worker_id, dp_rank)`; each batch's own dp rank overrides the
    registered one where it names one (as Dynamo does), so the sink gets `(worker_id, batch.dp_rank)`. `on_restart` is
    called with every worker key this stream delivered events for since the previous restart (the
    registered key if none), once each, when the engine's seq goes backwards. The sink also gets each
    batch's `SeqMark` (`stream_id`, seq): the router keeps the last one applied, and a stream started
    again on it (`resume_seq`) carries on after it.

    `run()` serves until `close()`; `stats` is a snapshot at any time. `clock` (monotonic seconds)
    only stamps `last_event_at` / `last_message_at`; replay timeouts use the event loop's clock.

    Payloads go to `decoder` in seq order and reach the sink in that order, maybe later (a
    `ProcessDecoder` decodes in a child): counters of what was delivered follow when it is. While
    `decoder` or `downstream` (the writer the sink feeds) is full, the stream stops reading and lets
    ZMQ buffer: past its high-water mark the engine's PUB drops, which the stream sees as a gap and
    replays, where a dropped decoded batch would be lost for good.

    A `ProcessDecoder` also receives: the SUB socket is then the child's, which sends each live
    message back decoded, and the stream sequences them exactly as it sequences what it reads itself
    (only the replay DEALER stays here). The child stops sending while `queue` (the writer's queue
    alone: batches in flight in the child cannot land before it reads them) is full. If the child
    dies, the stream opens its own SUB. Either refuses frames over `max_message_bytes`: `on_dropped` is told each
    time libzmq dropped the connection for one (it is made again at once; what was missed is a gap).
    """

    def __init__(
        self,
        worker: WorkerKey,
        endpoint: str,
        replay_endpoint: str | None,
        *,
        topic: str = "",
        block_size: int,
        sink: Sink,
        on_restart: OnRestart,
        replay_timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        context: zmq.asyncio.Context | None = None,
        rcvhwm: int = 100_000,
        decoder: Decoder | None = None,
        downstream: Backpressure | None = None,
        queue: Backpressure | None = None,
        resume_seq: int | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        on_dropped: Callable[[], None] = lambda: None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if replay_timeout_s <= 0:
            raise ValueError(f"replay_timeout_s must be positive, got {replay_timeout_s}")
        self.worker = worker
        self.endpoint = endpoint
        self.stream_id: StreamId = (worker, endpoint)
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.block_size = block_size
        self.replay_timeout_s = replay_timeout_s
        self._sink = sink
        self._on_restart = on_restart
        self._clock = clock
        self._decoder: Decoder = InlineDecoder() if decoder is None else decoder
        self._io = StreamSockets(endpoint, replay_endpoint, topic, rcvhwm, context, self._decoder, max_message_bytes,
                                 on_dropped)
        self._holds: tuple[Backpressure, ...] = (self._decoder,) if downstream is None else (self._decoder, downstream)
        self._queue: Backpressure = NeverFull() if queue is None else queue

        self._wake = asyncio.Event()  # a replay to time, or a socket to open: see _wait_for_replies
        self._run_task: asyncio.Task[None] | None = None
        self._serving = False
        self._closing = False

        self._last: int | None = resume_seq  # last seq applied (live or replayed)
        self._live = Numbering(once=True, last=resume_seq)  # the seqs received live: where each stands
        self._last_delivered: int | None = resume_seq  # last seq whose batch reached the sink (or failed to decode)
        self._resumed_from = resume_seq
        self._catch_up = resume_seq is not None  # until the first run asks the replay for what came after it
        self._replay: _Replay | None = None
        self._keys_seen: set[WorkerKey] = set()

        self._messages = 0
        self._batches = 0
        self._events = 0
        self._gaps = 0
        self._replays_ok = 0
        self._replays_failed = 0
        self._lost = 0
        self._duplicates = 0
        self._decode_errors: dict[str, int] = {}
        self._last_event_at: float | None = None
        self._last_message_at: float | None = None
        self._gapped = False
        self._schema = Schema()
        self.gap_log = GapLog(self._name(), clock)
        self.drops = StreamDrops(self._name())

    # -- public API ---------------------------------------------------------------------------

    @property
    def stats(self) -> StreamStats:
        return StreamStats(
            worker=self.worker,
            endpoint=self.endpoint,
            replay_endpoint=self.replay_endpoint,
            messages=self._messages,
            batches_applied=self._batches,
            events=self._events,
            last_seq=self._last_delivered,
            gaps=self._gaps,
            replays_ok=self._replays_ok,
            replays_failed=self._replays_failed,
            lost_batches=self._lost,
            restarts=self._live.restarts,
            duplicates=self._duplicates,
            jumps=self._live.jumps,
            decode_errors=dict(self._decode_errors),
            last_event_at=self._last_event_at,
            last_message_at=self._last_message_at,
            gapped=self._gapped,
            replaying=self._replay is not None,
            resumed_from=self._resumed_from,
            schema=self._schema.snapshot(),
        )

    async def run(self) -> None:
        """Connect and serve until `close()`; sockets are closed (linger 0) however it ends.

        After a run that raised, `run()` may be called again (by the same task or another): the counters
        and the seq position carry on, so what went by meanwhile shows as a gap, replayed or counted lost;
        a replay that was in flight is given up."""
        if self._serving:
            raise RuntimeError("EngineStream.run() is already running")
        task = asyncio.current_task()
        assert task is not None
        self._run_task = task
        if self._closing:
            return
        self._serving = True
        if self._replay is not None:
            self._replay = None
            self._replays_failed += 1
        try:
            self._open()
            if self._catch_up and self._io.dealer is not None:
                assert self._last is not None
                self._ask_replay(self._last + 1, deque(), catch_up=True)
            self._catch_up = False
            await self._serve()
        except asyncio.CancelledError:
            if not self._closing:
                raise
            task.uncancel()  # our own close(): a clean end, not a cancellation of the caller
        finally:
            self._serving = False
            self._io.close()

    def close(self) -> None:
        """Ask `run()` to stop; returns at once. Idempotent; safe before, during or after `run()`.

        From another task, `run()`'s task is cancelled at its current await and ends normally,
        sockets closed; from the sink or `on_restart` (inside `run()`), `run()` ends after the
        current batch. A stream closed before `run()` never connects.
        """
        self._closing = True
        task = self._run_task
        if task is None or task.done():
            self._io.close()
        elif task is not _current_task():
            task.cancel()

    async def aclose(self) -> None:
        """`close()`, then wait until `run()` has ended and its sockets are closed."""
        self.close()
        task = self._run_task
        if task is not None and task is not asyncio.current_task() and not task.done():
            await asyncio.wait({task})

    # -- sockets ------------------------------------------------------------------------------

    def _open(self) -> None:
        io = self._io
        io.open(Subscription(self.endpoint, self.topic, io.rcvhwm, self.block_size, self._on_received,
                             self._on_receiver_lost, self._queue, io.max_bytes, io.on_dropped))

    def _on_receiver_lost(self, why: str) -> None:
        """The decode process does not receive for us (any more): read our own socket from now on. What it
        had received and not sent is lost with it: the next message shows the gap."""
        self._io.key = None
        if not self._closing:
            log.warning("%s: %s; receiving in the router", self._name(), why)
            self._wake.set()  # the serve loop opens the socket: a failure there ends run(), as it should

    def _reset_dealer(self) -> None:
        self._io.reset_dealer(reopen=not self._closing)

    # -- the loop -----------------------------------------------------------------------------

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closing:
            assert self._io.poller is not None
            if self._io.key is None and self._io.sub is None:  # ours to read: from the start, or since the child let go
                self._io.open_sub()
            timeout_ms = None
            if self._replay is not None:
                timeout_ms = max(0, int((self._replay.deadline - loop.time()) * 1000) + 1)
            held = next((h for h in self._holds if h.full), None)
            if held is not None:
                await held.room()
                continue
            if self._io.key is None:
                ready = dict(await self._io.poller.poll(timeout_ms))
            else:
                ready = await self._wait_for_replies(timeout_ms)
            if self._io.dealer is not None and self._io.dealer in ready:
                await self._drain_replies(loop)
            if self._io.sub is not None and self._io.sub in ready:
                await self._drain_live()
            if self._replay is not None and loop.time() >= self._replay.deadline:
                self._replay_timed_out()

    async def _wait_for_replies(self, timeout_ms: int | None) -> dict[Any, int]:
        """While the decode process receives for us, only the DEALER is ours to wait on; a gap found in
        its answers (a replay to time) or its loss (a socket to open) sets `_wake`."""
        wake = self._wake
        if wake.is_set():
            wake.clear()
            return {}
        woken = asyncio.ensure_future(wake.wait())
        polling = None if self._io.dealer is None or self._io.poller is None else asyncio.ensure_future(
            self._io.poller.poll(timeout_ms))
        waits: set[asyncio.Future[Any]] = {woken} if polling is None else {woken, polling}
        try:
            await asyncio.wait(waits, timeout=None if timeout_ms is None else timeout_ms / 1000,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()
        wake.clear()
        return dict(polling.result()) if polling is not None and polling.done() and not polling.cancelled() else {}

    async def _drain_live(self) -> None:
        sub = self._io.sub
        assert sub is not None
        # Read through a synchronous shadow of the same socket: the asyncio wrapper builds a future per
        # message, which cost more than decoding it. The poller above still does the waiting.
        sync = self._io.sub_sync
        assert sync is not None
        end = time.perf_counter() + SLICE_S  # then back to the poller, which yields to the loop
        holds = self._holds
        while time.perf_counter() < end:
            if self._closing or any(h.full for h in holds):
                return
            try:
                frames = sync.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_live(frames)

    async def _drain_replies(self, loop: asyncio.AbstractEventLoop) -> None:
        dealer = self._io.dealer
        while (
            not self._closing
            and dealer is not None
            and dealer is self._io.dealer
            and cast(int, dealer.getsockopt(zmq.EVENTS)) & zmq.POLLIN  # an int option, typed as any option
        ):
            frames = await dealer.recv_multipart()
            if self._replay is None:
                continue  # nothing asked (cannot happen with a fresh DEALER per replay; be safe)
            self._replay.deadline = loop.time() + self.replay_timeout_s
            self._on_reply(frames)

    # -- sequencing ---------------------------------------------------------------------------

    def _on_live(self, frames: list[bytes]) -> None:
        self._messages += 1
        self._last_message_at = self._clock()
        seq = live_seq(frames)
        if seq is None:
            self._count_error(ErrorKind.bad_batch)
            return
        if sampled(self._messages):
            self._schema.observe_payload(frames[2])
        self._sequence(seq, frames)

    def _on_received(self, seq: int | None, result: EngineBatch | ErrorKind, seen: list[list[Any]] | None) -> None:
        """A live message the decode process received for this stream, decoded (`_on_live`'s twin)."""
        self._messages += 1
        self._last_message_at = self._clock()
        if seq is None:
            assert isinstance(result, ErrorKind)
            self._count_error(result)
            return
        if seen is not None:
            self._schema.merge_facts(seen)
        self._sequence(seq, result)

    def _sequence(self, seq: int, item: Received) -> None:
        previous = self._live.last
        order = self._live.observe(seq)
        if order is Order.jump:
            log.warning("%s: seq jumped from %s to %d: applied, the stream keeps its place", self._name(),
                        previous, seq)
            last = self._last
            self._apply(seq, item, marked=False)
            self._last = last
        elif order is Order.restart:
            assert previous is not None
            if self._replay is not None:
                self._abandon_replay()  # the old incarnation's replay and buffer no longer matter
            self._restart(previous, seq, item)
        elif self._replay is not None:
            self._replay.buffered.append((seq, item))
            self._drain_buffer()
        elif self._last is None:
            self._apply(seq, item)
        elif seq <= self._last:
            self._duplicates += 1  # applied already, by a replay
        elif seq == self._last + 1:
            self._apply(seq, item)
        else:
            self._gap(seq, item)

    def _gap(self, seq: int, item: Received) -> None:
        assert self._last is not None
        self._gaps += 1
        start = self._last + 1
        if self._io.dealer is None:
            self._lose(start, seq - 1, "no replay endpoint")
            self._apply(seq, item)
            return
        log.debug("%s: seq gap %d..%d, asking for a replay", self._name(), start, seq - 1)
        self._ask_replay(start, deque([(seq, item)]))

    def _ask_replay(self, start: int, buffered: deque[tuple[int, Received]], *, catch_up: bool = False) -> None:
        """Ask the engine's replay for every batch from `start` on; `buffered`: the live ones already here."""
        assert self._io.dealer is not None
        deadline = asyncio.get_running_loop().time() + self.replay_timeout_s
        self._replay = _Replay(start, deadline, buffered, lost_before=self._lost, catch_up=catch_up)
        self._io.dealer.send_multipart(encode_replay_request(start))
        self._wake.set()  # the serve loop now has a deadline to keep

    def _on_reply(self, frames: list[bytes]) -> None:
        try:
            reply = decode_replay_reply(frames)
        except DecodeError as exc:
            self._count_error(exc.kind)
            return
        assert self._last is not None
        if reply.end:
            self._finish_replay(timed_out=False)
        elif reply.seq <= self._last:
            self._duplicates += 1
        else:
            if reply.seq > self._last + 1:
                self._lose(self._last + 1, reply.seq - 1, "the engine's replay buffer no longer holds it")
            assert reply.payload is not None
            self._apply_payload(reply.seq, reply.payload)
            self._drain_buffer()

    def _replay_timed_out(self) -> None:
        self._finish_replay(timed_out=True)

    def _finish_replay(self, *, timed_out: bool) -> None:
        replay = self._replay
        assert replay is not None
        # A resumed stream's first replay unanswered, with nothing live either: its engine is not up (yet), and
        # nothing is known lost. The stream waits at its seq; the first live message shows what is missing.
        unheard = timed_out and replay.catch_up and not replay.buffered and self._last == replay.start - 1
        self._drain_buffer(final=f"replay timed out after {self.replay_timeout_s:g} s" if timed_out
                           else "the engine's replay ended without it")
        self._replay = None
        if unheard:
            log.info("%s: no answer from the replay at %s to catch up after seq %d; waiting for the engine",
                     self._name(), self.replay_endpoint, replay.start - 1)
            self._reset_dealer()
        elif timed_out:
            self._replays_failed += 1
            self._reset_dealer()
        elif self._lost > replay.lost_before:
            self._replays_failed += 1
        else:
            self._replays_ok += 1

    def _abandon_replay(self) -> None:
        self._replay = None
        self._reset_dealer()

    def _drain_buffer(self, *, final: str | None = None) -> None:
        """Apply buffered live messages that are next in seq order; with `final` (why what is still missing
        will not come), all of them."""
        replay = self._replay
        assert replay is not None and self._last is not None
        buffered = replay.buffered
        while buffered:
            seq, item = buffered[0]
            if seq <= self._last:
                self._duplicates += 1
            elif seq == self._last + 1:
                self._apply(seq, item)
            elif final is not None:
                self._lose(self._last + 1, seq - 1, final)
                self._apply(seq, item)
            else:
                return
            buffered.popleft()

    def _restart(self, last_live: int, seq: int, item: Received) -> None:
        log.warning("%s: seq went back from %d to %d: engine restart", self._name(), last_live, seq)
        self._gapped = False
        self._decoder.then(self._clear_seen)  # once the old incarnation's batches are all delivered
        if seq == 0:
            self._last = None
            self._apply(seq, item)
        else:  # the new engine's seqs 0..seq-1 left before we reconnected: a gap like any other
            self._last = -1
            self._gap(seq, item)

    def _clear_seen(self) -> None:
        self.drops.normalizer.forget_blocks()
        keys = sorted(self._keys_seen) or [self.worker]
        self._keys_seen.clear()
        for key in keys:
            self._on_restart(key)

    def _lose(self, first: int, last: int, why: str) -> None:
        """Seqs `first..last` will not be applied: counted, and logged by `gap_log` (rate-limited)."""
        self._lost += last - first + 1
        self._gapped = True
        self.gap_log.lost(first, last, why)

    # -- applying -----------------------------------------------------------------------------

    def _apply(self, seq: int, item: Received, *, marked: bool = True) -> None:
        """Take live `seq` as applied and deliver its events; an undecodable message is counted and skipped.
        Not `marked`: the index is not told the stream stands at `seq` (a jump's batch: see `_decoded`)."""
        if not isinstance(item, list):  # decoded already: delivered once everything submitted before it is
            self._last = seq
            self._decoder.then(partial(self._decoded, seq, marked, item))
            return
        frames = item
        try:  # live_seq has checked the frame count and the seq
            decode_topic(frames[0])
        except DecodeError as exc:
            self._last = seq
            self._decoder.then(partial(self._decoded, seq, marked, exc.kind))  # counted in turn
            return
        self._apply_payload(seq, frames[2], marked=marked)

    def _apply_payload(self, seq: int, payload: bytes, *, marked: bool = True) -> None:
        """The same for a replayed batch, whose frames the replay reply already checked."""
        self._last = seq
        self._decoder.submit(payload, self.block_size, partial(self._decoded, seq, marked),
                             self.drops.normalizer.salts_seen > 0)

    def _decoded(self, seq: int, marked: bool, result: EngineBatch | ErrorKind) -> None:
        """A `marked` batch's events reach the index with its `SeqMark`, where a restart resumes the stream; a
        jump's do not, since the stream keeps its place before it."""
        self._batches += 1
        self._last_delivered = seq
        if isinstance(result, ErrorKind):
            self._count_error(result)
        else:
            self._deliver(result, (self.stream_id, seq) if marked else None)

    def _deliver(self, batch: EngineBatch, mark: SeqMark | None) -> None:
        for error in batch.errors:
            self._count_error(error.kind)
        schema = self._schema
        dp_rank = self.worker[1] if batch.dp_rank is None else batch.dp_rank
        schema.dp_ranks.add(dp_rank)
        events = self.drops.admit(dp_rank, batch)
        if not events:
            return
        for event in events:
            tier = getattr(event, "tier", None)
            if tier is not None:
                schema.tiers.add(TIER_VALUES[tier])
        key = (self.worker[0], dp_rank)
        self._keys_seen.add(key)
        self._events += len(events)
        self._last_event_at = self._clock()
        self._sink(key, events, mark)

    def _count_error(self, kind: ErrorKind) -> None:
        label = kind.value
        self._decode_errors[label] = self._decode_errors.get(label, 0) + 1

    def _name(self) -> str:
        return f"engine stream {format_worker(self.worker)} ({self.endpoint})"


def _current_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running loop
        return None
