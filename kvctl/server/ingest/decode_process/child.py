"""The router's decode process: requests in on stdin, answers out on stdout (`kvctl.server.ingest.decode_process.wire`).

Started by `parent.ProcessDecoder` as `python -m kvctl.server.ingest.decode_process.child`; it ends when its stdin
closes. It decodes the payloads the router sends (replayed batches), and receives and decodes the live messages of
the engine streams the router hands it, one SUB socket each. Everything it reads is answered: a message that does
not decode is answered with its error kind, so the router counts it exactly as it would have in-process. It keeps no
state beyond its sockets: sequencing, replays and counters stay in the router.

When the router falls behind, it stops reading stdout; this process then blocks on its write and stops
reading its sockets, and a burst waits in ZMQ exactly as it would in the router's own sockets. Once a
burst is over, the memory it went through goes back to the system (`BurstTrimmer`), as in the router.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass

import zmq

from kvctl.runtime import BurstTrimmer, tune_gc
from kvctl.server.ingest.decode_process.wire import CONTROL, answer, live_answer, read_control, refused, split_requests
from kvctl.server.ingest.fd_limits import sized
from kvctl.server.ingest.schema_seen import sampled

_READ = 1 << 20
_BURST = 64
"""Live messages taken from one socket before the others get a turn."""
_IDLE_MS = 50
"""While a trim is due but was too recent to repeat, how often to try again."""


@dataclass(slots=True)
class _Sub:
    key: int
    block_size: int
    messages: int = 0


class _Receiver:
    def __init__(self, fd_in: int) -> None:
        self.fd_in = fd_in
        self.context = sized(zmq.Context())
        self.poller = zmq.Poller()
        self.poller.register(fd_in, zmq.POLLIN)
        self.subs: dict[zmq.Socket[bytes], _Sub] = {}
        self.by_key: dict[int, zmq.Socket[bytes]] = {}

    def command(self, command: list[object], out: list[bytes]) -> None:
        verb, key = command[0], command[1]
        assert isinstance(key, int)
        if verb == "open":
            _, _, endpoint, topic, rcvhwm, block_size = command
            assert isinstance(endpoint, str) and isinstance(topic, str)
            assert isinstance(rcvhwm, int) and isinstance(block_size, int)
            sub: zmq.Socket[bytes] | None = None
            try:
                sub = self.context.socket(zmq.SUB)
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.RCVHWM, rcvhwm)
                sub.setsockopt_string(zmq.SUBSCRIBE, topic)
                sub.connect(endpoint)
            except zmq.ZMQError as exc:  # one stream's bad endpoint (or no socket left) must not take the others
                if sub is not None:
                    sub.close(linger=0)
                out.append(refused(key, f"cannot subscribe to {endpoint}: {exc}"))
                return
            self.subs[sub] = _Sub(key, block_size)
            self.by_key[key] = sub
            self.poller.register(sub, zmq.POLLIN)
        elif verb == "close":
            sub = self.by_key.pop(key, None)
            if sub is not None:
                del self.subs[sub]
                self.poller.unregister(sub)
                sub.close(linger=0)

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
            out.append(live_answer(stream.key, frames, stream.block_size, sampled(stream.messages)))

    def close(self) -> None:
        for sock in self.subs:
            sock.close(linger=0)
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
                ready = receiver.poller.poll(_IDLE_MS if trimmer.due else None)
                if not ready:
                    continue
            for item, _ in ready:
                out: list[bytes] = []
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
