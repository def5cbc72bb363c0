"""The router's decode process: requests in on stdin, answers out on stdout (`kvctl.server.ingest.decode_process.wire`).

Started by `parent.ProcessDecoder` as `python -m kvctl.server.ingest.decode_process.child`; it ends when its stdin
closes. It decodes the payloads the router sends (replayed batches), and receives and decodes the live messages of
the engine streams the router hands it, one SUB socket each. Everything it reads is answered: a message that does
not decode is answered with its error kind, so the router counts it exactly as it would have in-process. It keeps no
state beyond its sockets: sequencing, replays and counters stay in the router.

Each SUB refuses frames over the size the router gives (`kvctl.zmq_limits`); its monitor is read with the rest,
and a connection libzmq dropped for such a frame is made again and reported (`DROPPED`).

When the router falls behind, it stops reading stdout; this process then blocks on its write and stops
reading its sockets, and a burst waits in ZMQ exactly as it would in the router's own sockets. Once a
burst is over, the memory it went through goes back to the system (`BurstTrimmer`), as in the router.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass

import zmq

from kvctl.runtime import BurstTrimmer, tune_gc
from kvctl.server.ingest.decode_process.wire import (
    CONTROL,
    answer,
    dropped,
    live_answer,
    read_control,
    refused,
    split_requests,
)
from kvctl.server.ingest.fd_limits import sized
from kvctl.server.ingest.schema_seen import sampled
from kvctl.zmq_limits import WATCHED, Drops, limited, reconnect, waiting_events

_READ = 1 << 20
_BURST = 64
"""Live messages taken from one socket before the others get a turn."""
_IDLE_MS = 50
"""While a trim is due but was too recent to repeat, how often to try again."""


@dataclass(slots=True)
class _Sub:
    key: int
    block_size: int
    monitor: zmq.Socket[bytes]
    messages: int = 0
    salted: bool = False  # the stream stored salted blocks: its unsalted stores go with their token ids


class _Receiver:
    def __init__(self, fd_in: int) -> None:
        self.fd_in = fd_in
        self.context = sized(zmq.Context())
        self.poller = zmq.Poller()
        self.poller.register(fd_in, zmq.POLLIN)
        self.subs: dict[zmq.Socket[bytes], _Sub] = {}
        self.by_key: dict[int, zmq.Socket[bytes]] = {}
        self.monitors: dict[zmq.Socket[bytes], zmq.Socket[bytes]] = {}  # monitor -> its SUB
        self.drops: Drops[tuple[int, str]] = Drops()  # (stream key, endpoint)

    def command(self, command: list[object], out: list[bytes]) -> None:
        verb, key = command[0], command[1]
        assert isinstance(key, int)
        if verb == "open":
            _, _, endpoint, topic, rcvhwm, block_size, max_bytes = command
            assert isinstance(endpoint, str) and isinstance(topic, str)
            assert isinstance(rcvhwm, int) and isinstance(block_size, int) and isinstance(max_bytes, int)
            sub: zmq.Socket[bytes] | None = None
            monitor: zmq.Socket[bytes] | None = None
            try:
                sub = limited(self.context.socket(zmq.SUB), max_bytes)
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.RCVHWM, rcvhwm)
                sub.setsockopt_string(zmq.SUBSCRIBE, topic)
                monitor = sub.get_monitor_socket(WATCHED)
                sub.connect(endpoint)
            except zmq.ZMQError as exc:  # one stream's bad endpoint (or no socket left) must not take the others
                for sock in (monitor, sub):
                    if sock is not None:
                        sock.close(linger=0)
                out.append(refused(key, f"cannot subscribe to {endpoint}: {exc}"))
                return
            self.subs[sub] = _Sub(key, block_size, monitor)
            self.by_key[key] = sub
            self.monitors[monitor] = sub
            self.poller.register(sub, zmq.POLLIN)
            self.poller.register(monitor, zmq.POLLIN)
        elif verb == "close":
            sub = self.by_key.pop(key, None)
            if sub is not None:
                self._close(sub)

    def _close(self, sub: zmq.Socket[bytes]) -> None:
        stream = self.subs.pop(sub)
        del self.monitors[stream.monitor]
        for sock in (sub, stream.monitor):
            self.poller.unregister(sock)
        with contextlib.suppress(zmq.ZMQError):
            sub.disable_monitor()
        stream.monitor.close(linger=0)
        sub.close(linger=0)

    def watch(self, monitor: zmq.Socket[bytes]) -> None:
        """One round of a SUB's monitor events."""
        sub = self.monitors.get(monitor)
        if sub is None:  # closed by a command earlier in this round
            return
        key = self.subs[sub].key
        for event, endpoint in waiting_events(monitor):
            self.drops.seen(event, (key, endpoint), time.monotonic())

    def reconnect_dropped(self, out: list[bytes]) -> None:
        """Connect again what libzmq dropped for a frame too large, and tell the router."""
        for key, endpoint in self.drops.due(time.monotonic()):
            sub = self.by_key.get(key)
            if sub is not None:  # else closed since
                reconnect(sub, endpoint)
                out.append(dropped(key))

    def timeout_ms(self) -> int | None:
        """Until the next connection is known dropped or not; None when none waits."""
        timeout = self.drops.timeout(time.monotonic())
        return None if timeout is None else int(timeout * 1000) + 1

    def receive(self, sock: zmq.Socket[bytes], out: list[bytes]) -> None:
        stream = self.subs.get(sock)
        if stream is None:  # closed by a command earlier in this round
            return
        for _ in range(_BURST):
            try:
                frames = _recv_message(sock)
            except zmq.Again:
                return
            stream.messages += 1
            body, salted = live_answer(stream.key, frames, stream.block_size, sampled(stream.messages), stream.salted)
            stream.salted = stream.salted or salted
            out.append(body)

    def close(self) -> None:
        for sub in list(self.subs):
            self._close(sub)
        self.context.term()


def _recv_message(sock: zmq.Socket[bytes]) -> list[bytes]:
    """`sock.recv_multipart(zmq.NOBLOCK)`, a third cheaper: each frame says whether another follows, where
    pyzmq asks the socket (RCVMORE) and builds an option enum to do it, ~1.5 us a message. ZMQ delivers a
    multipart message whole, so the frames after the first are there already."""
    frame = sock.recv(zmq.NOBLOCK, copy=False)
    frames = [frame.bytes]
    while frame.more:
        frame = sock.recv(zmq.NOBLOCK, copy=False)
        frames.append(frame.bytes)
    return frames


def serve(fd_in: int, fd_out: int) -> None:
    receiver = _Receiver(fd_in)
    trimmer = BurstTrimmer()
    pending = bytearray()
    try:
        while True:
            ready = receiver.poller.poll(0)
            if not ready:  # caught up: give a burst's memory back (at most once a second), then wait
                trimmer.idle()
                waits = [t for t in (_IDLE_MS if trimmer.due else None, receiver.timeout_ms()) if t is not None]
                ready = receiver.poller.poll(min(waits) if waits else None)
            out: list[bytes] = []
            receiver.reconnect_dropped(out)
            _write_all(fd_out, b"".join(out))
            for item, _ in ready:
                out = []
                if item in receiver.monitors:
                    receiver.watch(item)
                    continue
                if item == fd_in:
                    chunk = os.read(fd_in, _READ)
                    if not chunk:
                        return
                    pending += chunk
                    for payload, block_size in split_requests(pending):
                        if block_size == CONTROL:
                            receiver.command(read_control(payload), out)
                        else:
                            out.append(answer(payload, block_size))
                else:
                    receiver.receive(item, out)
                # Sent after each socket's turn, not after the round: a round over 128 busy sockets is
                # seconds of decoding, which the router would otherwise spend waiting.
                trimmer.applied(len(out))
                _write_all(fd_out, b"".join(out))
    finally:
        receiver.close()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def main() -> None:
    # The router owns the signals: a Ctrl-C in its terminal reaches this process too, and it must
    # keep answering until the router has drained and closes the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tune_gc()
    with contextlib.suppress(BrokenPipeError):  # the router is gone
        serve(0, 1)


if __name__ == "__main__":
    main()
