"""An engine's KV-event sockets, as vLLM's ZmqEventPublisher runs them: PUB for live batches, ROUTER for replay.

Live: every batch goes out on PUB as `[topic, seq u64 BE, payload]`, seq counting from 0 per
publisher (a restart starts again at 0). PUB never blocks: a slow subscriber loses batches at the
high-water mark, as with a real engine, and repairs the gap through replay. The PUB is an XPUB, which
also hears each subscription: `subscriptions()` says when a subscriber has joined, so a caller waits for
that instead of guessing how long ZMQ's "slow joiner" takes (batches sent before it are not delivered).

Replay: the last `buffer_steps` batches are kept; a DEALER's `[b"", start u64 BE]` (seen by the
ROUTER as `[identity, b"", start]`) is answered with every buffered batch with seq >= start, as
`[b"", topic, seq, payload]` (or `[b"", seq, payload]` for producers older than vLLM 0.26), then
the end marker: seq 0xFFFFFFFFFFFFFFFF with an empty payload. Malformed requests are ignored, as
vLLM ignores them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

import zmq
import zmq.asyncio

END_SEQ = (1 << 64) - 1


class Publisher:
    """Real PUB + ROUTER sockets bound on `host`; port 0 picks a free port."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        replay_port: int = 0,
        *,
        topic: str = "",
        replay_topic: bool = True,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        self.topic = topic
        self.replay_topic = replay_topic
        self.next_seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = zmq.asyncio.Context()
        self._pub = zmq.Socket(self._ctx, zmq.XPUB)  # a plain socket: publish() sends synchronously, in order
        self._pub.set(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not only a topic's first
        self._subscriptions = 0
        self._router = self._ctx.socket(zmq.ROUTER)
        self._pub.set_hwm(hwm)
        self._router.set(zmq.SNDHWM, 2 * (buffer_steps + 1))  # a whole replay fits (vLLM 0.33)
        for sock in (self._pub, self._router):
            sock.set(zmq.LINGER, 0)
        try:
            self.endpoint = _bind(self._pub, host, port)
            self.replay_endpoint = _bind(self._router, host, replay_port)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start answering replay requests (needs a running event loop)."""
        self._task = asyncio.get_running_loop().create_task(self._serve_replays())

    def publish(self, payload: bytes, *, live: bool = True) -> int:
        """Buffer one batch under the next seq and send it on PUB unless `live` is False; returns its seq.

        Synchronous on purpose: batches leave in the order the engine made them, whatever the tasks do.
        """
        seq = self.next_seq
        self.next_seq += 1
        self._buffer.append((seq, payload))
        if live:
            self._pub.send_multipart([self.topic.encode(), seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        return seq

    def subscriptions(self) -> int:
        """How many subscriptions have reached the PUB so far: once one has, what is published next is delivered
        to that subscriber."""
        while True:
            try:
                message = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return self._subscriptions
            self._subscriptions += message[:1] == b"\x01"

    def reset(self) -> None:
        """Forget the buffer and count from 0 again, as a restarted engine does."""
        self.next_seq = 0
        self._buffer.clear()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)  # not tracked by the asyncio context: destroy() alone would wait for it
        self._ctx.destroy(linger=0)

    async def _serve_replays(self) -> None:
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3 or frames[1] or len(frames[2]) != 8:
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._router.send_multipart([identity, b"", *self._frames(seq, payload)])
            await self._router.send_multipart([identity, b"", *self._frames(END_SEQ, b"")])

    def _frames(self, seq: int, payload: bytes) -> list[bytes]:
        seq_frame = seq.to_bytes(8, "big")
        if not self.replay_topic:
            return [seq_frame, payload]
        topic = b"" if seq == END_SEQ else self.topic.encode()
        return [topic, seq_frame, payload]


def _bind(sock: zmq.Socket, host: str, port: int) -> str:
    if port:
        sock.bind(f"tcp://{host}:{port}")
    else:
        port = sock.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{port}"
