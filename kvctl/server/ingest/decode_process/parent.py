"""Where engine payloads are received and decoded: in the router's own loop, or in a child process beside it.

Receiving a batch from ZMQ and decoding it (msgpack, then one XXH3 per block of token ids) costs more
than applying it does, and the router is one Python thread. With a spare core,
`ProcessDecoder` runs `python -m kvctl.server.ingest.decode_process.child`, which subscribes to the engines the
streams hand it (`receive`) and sends their messages back decoded, many per read, and decodes the
payloads the router submits (replayed batches) in the same order they were submitted. Ingest runs on
two cores, and the loop that answers routes is freed of most of the ingest work. Everything else
(seq tracking, replays, counters, the index) stays in the router; the child holds no state but its
sockets. If it dies, the router logs it and works alone meanwhile: it decodes the payloads the
child had not answered, in order, and each stream the child received for opens its own socket; what
the child had received and not sent is a gap the stream replays like any other (or counts as lost).
A new child is started after a backoff (`RESPAWN_MIN_S`, doubling while children keep dying young), for
what is submitted and subscribed from then on; status shows the failure meanwhile, and the last error.

Both decoders keep submission order across everything submitted, streams included, and `then()`
runs a callback once everything submitted before it has been delivered: an engine restart clears
its worker only after that worker's earlier batches are in.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvctl.child_process import python_module
from kvctl.core.events import EngineBatch, ErrorKind, EventData
from kvctl.core.words import counted
from kvctl.server.ingest.decode_process.wire import (
    HEADER,
    Answer,
    Dropped,
    Refused,
    control,
    decode_now,
    split_answers,
)
from kvctl.server.serve_choices import DecoderMode
from kvctl.zmq_limits import MAX_MESSAGE_BYTES

__all__ = ["Backpressure", "Decoded", "Decoder", "InlineDecoder", "NeverFull", "OnLive",
           "ProcessDecoder", "Subscription", "make_decoder", "usable_cpus"]

log = logging.getLogger("kvctl.serve")

Decoded = Callable[[EngineBatch | ErrorKind], None]
"""Receives a decoded batch, or the kind of error that made the whole payload unusable."""

OnLive = Callable[[int | None, EngineBatch | ErrorKind, list[list[Any]] | None], None]
"""Receives a live message decoded by the decode process: its seq (None: the frames had none), the
batch or error kind, and what its payload shows of the stream's schema when the schema samples it
(`kvctl.server.ingest.schema_seen.facts_of`)."""

MAX_PENDING = 4096
"""Payloads the child may be behind by before sources stop reading their sockets (ZMQ then buffers)."""

_READ = 64 * 1024
"""Read per wake-up, all decoded and handed on at once: ~2 ms of the loop for a pipe full of removals."""
_PIPE_BYTES = 1 << 20  # a pipe of 1 MiB: a millisecond's payloads fit in one write
QUIET_S = 0.1
"""What the decode process received for the streams is invisible until it is read: this long with nothing
read from it, and nothing submitted unanswered, is how the router knows that no burst is going on."""

RESPAWN_MIN_S = 0.5
RESPAWN_MAX_S = 30.0
"""Backoff before a new decode process: doubling from the first to the second while each dies within
`RESPAWN_MAX_S` of its start."""

_FLUSH_S = 0.001
_FLUSH_BYTES = 256 * 1024
"""Payloads are written to the child in runs: a write per millisecond (or per 256 KiB) rather than one
per payload halves what the pipe costs both processes in wake-ups, for at most a millisecond of delay."""


class Backpressure(Protocol):
    """Something a source feeds that can fall behind: while `full`, the source waits for `room()`."""

    @property
    def full(self) -> bool: ...
    async def room(self) -> None: ...


class NeverFull:
    """Backpressure that never holds: for what has no bound of its own."""

    full = False

    async def room(self) -> None:
        return


@dataclass(frozen=True, slots=True)
class Subscription:
    """What a stream asks the decode process to receive for it (see `Decoder.receive`).

    `on_lost(why)` is called when the decode process is gone, or could not subscribe, and the stream
    must read its own socket; `hold` is where the stream's batches go, which answers wait on while it is
    full; `on_dropped()` when libzmq dropped the connection for a frame over `max_bytes` (made again)."""

    endpoint: str
    topic: str
    rcvhwm: int
    block_size: int
    on_live: OnLive
    on_lost: Callable[[str], None]
    hold: Backpressure
    max_bytes: int = MAX_MESSAGE_BYTES
    on_dropped: Callable[[], None] = lambda: None


class Decoder(Backpressure, Protocol):
    in_flight: int  # submitted, not yet delivered

    def receive(self, subscription: Subscription) -> int | None: ...
    def stop_receiving(self, key: int) -> None: ...
    def idle(self) -> bool: ...
    def submit(self, payload: bytes, block_size: int, done: Decoded, keep_tokens: bool = False) -> None: ...
    def then(self, callback: Callable[[], None]) -> None: ...
    async def drained(self) -> None: ...
    async def close(self) -> None: ...
    def status(self) -> dict[str, Any]: ...


class InlineDecoder(NeverFull):
    """Decode on the spot, in the caller's loop."""

    in_flight = 0

    def receive(self, subscription: Subscription) -> int | None:
        return None  # the stream reads its own socket

    def stop_receiving(self, key: int) -> None:
        return

    def idle(self) -> bool:
        return True

    def submit(self, payload: bytes, block_size: int, done: Decoded, keep_tokens: bool = False) -> None:
        done(decode_now(payload, block_size, keep_tokens))

    def then(self, callback: Callable[[], None]) -> None:
        callback()

    async def drained(self) -> None:
        return

    async def close(self) -> None:
        return

    def status(self) -> dict[str, Any]:
        return {"mode": "inline"}


class ProcessDecoder:
    """Decode in a child process; answers are delivered in submission order by the event loop."""

    def __init__(self, *, max_pending: int = MAX_PENDING, respawn_min_s: float = RESPAWN_MIN_S) -> None:
        self._loop = asyncio.get_running_loop()
        self._proc: subprocess.Popen[bytes] | None = None
        self._to_child = self._from_child = -1
        self._spawn()
        self._max_pending = max_pending
        self._respawn_min_s = respawn_min_s
        self._respawn_delay = respawn_min_s
        self._respawning: asyncio.Task[None] | None = None
        self._closed = False
        self.restarts = 0  # children started after one died
        self.last_error: str | None = None
        # in submission order: (payload, block size, done) awaiting an answer, or a callback for then()
        self._pending: deque[tuple[bytes, int, Decoded] | Callable[[], None]] = deque()
        self.in_flight = 0
        self._outbox = bytearray()
        self._inbox = bytearray()
        self._held: list[EventData] = []  # the parts of a large batch read so far (wire.PART)
        self._answers: deque[Answer] = deque()  # read, not yet delivered
        self._flush_soon = False
        self._waiting_to_write = False
        self._room = asyncio.Event()
        self._room.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._decoded = 0
        self._failure: str | None = None  # why the child is gone; decoding is in-process since
        self._subscriptions: dict[int, Subscription] = {}
        self._holds: list[Backpressure] = []  # the distinct holds of the subscriptions
        self._next_key = 0
        self._resuming: asyncio.Task[None] | None = None  # while answers wait for a hold to have room
        self._read_at = float("-inf")  # monotonic time of the last read from the child

    def _spawn(self) -> None:
        self._proc = subprocess.Popen(python_module("kvctl.server.ingest.decode_process.child"), stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._to_child = self._proc.stdin.fileno()
        self._from_child = self._proc.stdout.fileno()
        for fd in (self._to_child, self._from_child):
            os.set_blocking(fd, False)
            with contextlib.suppress(OSError, AttributeError):  # Linux only; the default 64 KiB still works
                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        self._loop.add_reader(self._from_child, self._on_readable)
        self._spawned_at = time.monotonic()

    async def _respawn(self, delay: float) -> None:
        """A new child after `delay`, for what is submitted and subscribed from then on."""
        await asyncio.sleep(delay)
        try:
            self._spawn()
        except OSError as exc:  # out of descriptors or processes: stay in-process, try again later
            self._schedule_respawn(f"cannot start the decode process: {exc}")
            return
        self._failure = None
        self._flush_soon = False  # a flush that found no child left this set
        self.restarts += 1
        log.warning("decode process started again (pid %d)", self._proc.pid if self._proc is not None else -1)

    def _schedule_respawn(self, why: str) -> None:
        self.last_error = why
        if self._closed:
            return
        young = time.monotonic() - self._spawned_at < RESPAWN_MAX_S
        delay = self._respawn_delay
        self._respawn_delay = min(delay * 2, RESPAWN_MAX_S) if young else self._respawn_min_s
        self._respawning = self._loop.create_task(self._respawn(delay))

    # -- the Decoder protocol ------------------------------------------------------------------

    @property
    def full(self) -> bool:
        return self.in_flight >= self._max_pending

    def receive(self, subscription: Subscription) -> int | None:
        """Have the child subscribe for a stream; returns the key of its answers, None when the stream must
        read its own socket: the child is gone, or the endpoint is `inproc://` (the router's own context)."""
        if self._failure is not None or subscription.endpoint.startswith("inproc://"):
            return None
        self._next_key += 1
        key = self._next_key
        self._subscriptions[key] = subscription
        self._gather_holds()
        self._outbox += control(["open", key, subscription.endpoint, subscription.topic, subscription.rcvhwm,
                                 subscription.block_size, subscription.max_bytes])
        self._send_soon()
        return key

    def stop_receiving(self, key: int) -> None:
        """Unsubscribe; answers of `key` still on their way are dropped."""
        if self._subscriptions.pop(key, None) is None:
            return
        self._gather_holds()
        if self._failure is None:
            self._outbox += control(["close", key])
            self._send_soon()

    def _gather_holds(self) -> None:
        self._holds = list({id(s.hold): s.hold for s in self._subscriptions.values()}.values())

    def idle(self) -> bool:
        """Nothing submitted is unanswered, and nothing came from the child for `QUIET_S`."""
        return not self.in_flight and not self._answers and time.monotonic() - self._read_at >= QUIET_S

    def submit(self, payload: bytes, block_size: int, done: Decoded, keep_tokens: bool = False) -> None:
        """The child keeps a replayed store's token ids whatever `keep_tokens` says (`wire.answer`)."""
        if self._failure is not None:
            done(decode_now(payload, block_size, keep_tokens))
            return
        self._pending.append((payload, block_size, done))
        self.in_flight += 1
        self._idle.clear()
        if self.in_flight >= self._max_pending:
            self._room.clear()
        outbox = self._outbox
        outbox += HEADER.pack(len(payload), block_size)
        outbox += payload
        self._send_soon()

    def then(self, callback: Callable[[], None]) -> None:
        if self._pending:
            self._pending.append(callback)
        else:
            callback()

    async def room(self) -> None:
        await self._room.wait()

    async def drained(self) -> None:
        await self._idle.wait()

    async def close(self) -> None:
        """Stop the child once it has answered everything submitted (callers drain sources first)."""
        self._closed = True
        if self._respawning is not None:
            self._respawning.cancel()
        await self.drained()
        self._stop_child()
        self._failure = "stopped"

    def status(self) -> dict[str, Any]:
        proc = self._proc
        return {"mode": "process", "pid": None if proc is None else proc.pid, "in_flight": self.in_flight,
                "decoded": self._decoded, "receiving": len(self._subscriptions), "failed": self._failure,
                "restarts": self.restarts, "last_error": self.last_error}

    # -- the pipe ------------------------------------------------------------------------------

    def _send_soon(self) -> None:
        if self._waiting_to_write:
            return
        if len(self._outbox) >= _FLUSH_BYTES:
            self._flush()
        elif not self._flush_soon:
            self._flush_soon = True
            self._loop.call_later(_FLUSH_S, self._flush)

    def _flush(self) -> None:
        if self._failure is not None:
            return
        try:
            while self._outbox:
                written = os.write(self._to_child, self._outbox)
                del self._outbox[:written]
        except BlockingIOError:
            if not self._waiting_to_write:
                self._waiting_to_write = True
                self._loop.add_writer(self._to_child, self._flush)
            return
        except OSError as exc:  # EPIPE: the child is gone; its EOF on the other pipe says so too
            self._fail(f"cannot write to the decode process: {exc}")
            return
        self._flush_soon = False
        if self._waiting_to_write:
            self._waiting_to_write = False
            self._loop.remove_writer(self._to_child)

    def _on_readable(self) -> None:
        try:
            chunk = os.read(self._from_child, _READ)
        except BlockingIOError:
            return
        except OSError as exc:
            self._fail(f"cannot read from the decode process: {exc}")
            return
        if not chunk:
            self._fail("the decode process exited")
            return
        self._read_at = time.monotonic()
        self._inbox += chunk
        self._answers.extend(split_answers(self._inbox, self._held))
        self._dispatch(hold=True)

    def _dispatch(self, *, hold: bool) -> None:
        """Deliver the answers read so far, in order; with `hold`, stop while a subscription's hold is full.

        Reading stops with it: the child then blocks on its writes and stops receiving, and a burst
        waits in ZMQ (where a gap can be replayed) rather than in a writer queue that would drop it."""
        answers, subscriptions, holds = self._answers, self._subscriptions, self._holds
        while answers:
            if hold and holds:
                held = next((h for h in holds if h.full), None)
                if held is not None:
                    if self._resuming is None:
                        self._loop.remove_reader(self._from_child)
                        self._resuming = self._loop.create_task(self._read_again(held))
                    break
            answer = answers.popleft()
            if type(answer) is tuple:  # a Live message
                key, seq, seen, result = answer
                subscription = subscriptions.get(key)
                if subscription is not None:  # else unsubscribed since
                    subscription.on_live(seq, result, seen)
                continue
            if type(answer) is Dropped:
                subscription = subscriptions.get(answer.key)
                if subscription is not None:
                    subscription.on_dropped()
                continue
            if type(answer) is Refused:
                subscription = subscriptions.pop(answer.key, None)
                if subscription is not None:
                    self._gather_holds()
                    holds = self._holds
                    subscription.on_lost(answer.why)
                continue
            payload_done = self._pending.popleft()
            assert isinstance(payload_done, tuple)
            self.in_flight -= 1
            self._decoded += 1
            payload_done[2](answer)  # type: ignore[arg-type]
            self._run_callbacks()
        self._settle()

    async def _read_again(self, held: Backpressure) -> None:
        await held.room()
        self._resuming = None
        self._dispatch(hold=True)
        if self._resuming is None and self._proc is not None:
            self._loop.add_reader(self._from_child, self._on_readable)

    def _run_callbacks(self) -> None:
        pending = self._pending
        while pending and not isinstance(pending[0], tuple):
            pending.popleft()()  # type: ignore[operator]

    def _settle(self) -> None:
        if self.in_flight < self._max_pending // 2:
            self._room.set()
        if not self._pending:
            self._idle.set()

    def _fail(self, why: str) -> None:
        """The child is gone: decode what it had not answered here, in order, and everything after."""
        proc = self._proc
        code = None if proc is None else proc.poll()
        self._failure = failure = why if code is None else f"{why} (exit status {code})"
        log.error("%s; decoding in the router's own process until a new one starts (%s taken back)",
                  self._failure, counted(self.in_flight, "batch", "batches"))
        self._stop_child()
        self._dispatch(hold=False)  # what was read is good: delivered first, in order
        pending, self._pending = self._pending, deque()
        self.in_flight = 0
        self._outbox.clear()
        self._inbox.clear()
        self._held.clear()
        for entry in pending:
            if isinstance(entry, tuple):
                payload, block_size, done = entry
                done(decode_now(payload, block_size, keep_tokens=True))
            else:
                entry()
        self._settle()
        subscriptions, self._subscriptions = self._subscriptions, {}
        self._holds = []
        for subscription in subscriptions.values():
            subscription.on_lost("the decode process is gone")
        self._schedule_respawn(failure)

    def _stop_child(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        self._loop.remove_reader(self._from_child)
        if self._resuming is not None:
            self._resuming.cancel()
            self._resuming = None
        if self._waiting_to_write:
            self._waiting_to_write = False
            self._loop.remove_writer(self._to_child)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def make_decoder(mode: DecoderMode) -> Decoder:
    """`inline`, `process`, or `auto`: a process wherever this one may run on two cores or more.

    On a 2-core host, 1M (worker, block) pairs (benchmarks/serve_bench.py, three runs each): stored
    blocks/s from 16 engines 0.81M, 0.71M, 0.87M with the process against 0.48M, 0.44M, 0.55M inline,
    from 128 engines 0.63M-0.68M against 0.49M-0.55M; removals and route latency the same within the
    noise. On one core the child only adds the pipe.
    """
    if mode == DecoderMode.auto:
        cpus = usable_cpus()
        mode = DecoderMode.process if cpus >= 2 else DecoderMode.inline
        log.info("--decoder auto: %s (%g usable CPUs)", "a decode process" if mode == DecoderMode.process else "inline",
                 cpus)
    return ProcessDecoder() if mode == DecoderMode.process else InlineDecoder()


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def usable_cpus(cpu_max: Path | None = None) -> float:
    """Cores this process may use: the CPUs it may be scheduled on, capped by a cgroup v2 CPU quota.

    A router in a Kubernetes pod with a CPU limit of 1 sees every core of the node in its affinity mask,
    and its quota (`cpu.max`: "100000 100000") is what it really gets: a second process there would
    only be throttled with it."""
    cpus = float(len(os.sched_getaffinity(0)))
    try:
        quota, period = (cpu_max or CGROUP_CPU_MAX).read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, int(quota) / int(period))
    except (OSError, ValueError, ZeroDivisionError):  # no cgroup v2, or a file we do not read: the affinity stands
        pass
    return cpus
