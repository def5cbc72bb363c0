"""An engine's KV-event side as vLLM's ZmqEventPublisher runs it: real PUB (as XPUB) + ROUTER sockets.

Every batch goes to a replay buffer and out on PUB as `[topic, seq u64 BE, payload]`; the ROUTER
answers `[b"", start]` with every buffered batch with seq >= start, as `[b"", topic, seq, payload]`
(vLLM >= 0.26, SGLang) or `[b"", seq, payload]` (older vLLM), then the end marker. The payloads the
tests send are the fixtures' real captured bytes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

END = (2**64 - 1).to_bytes(8, "big")


@dataclass
class Engine:
    """A publisher with a replay buffer: real PUB + ROUTER sockets bound on 127.0.0.1."""

    ctx: zmq.asyncio.Context
    topic_frame: bool = True  # False: legacy 3-frame replay replies
    mute: bool = False  # True: read replay requests, never answer
    release: asyncio.Event = field(default_factory=asyncio.Event)  # replies wait for this
    requests: list[int] = field(default_factory=list)  # start seqs asked for
    buffer: list[tuple[int, str, bytes]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.release.set()
        self.pub = self.ctx.socket(zmq.XPUB)  # a PUB that also hears subscriptions: no slow-joiner guessing
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)  # ample: the burst test outpaces the SUB
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.replay_endpoint = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        self.request_seen = asyncio.Event()
        self._task = asyncio.ensure_future(self._serve_replays())

    async def publish(self, seq: int, payload: bytes, topic: str = "", *, live: bool = True) -> None:
        self.buffer.append((seq, topic, payload))
        if live:
            await self.pub.send_multipart([topic.encode(), seq.to_bytes(8, "big"), payload])

    async def subscribed(self, timeout: float = 3.0) -> None:
        """Wait until a subscriber's subscription has reached this socket: what is sent next is delivered. An
        earlier subscriber's unsubscription (it closed) may come first."""
        while (message := await asyncio.wait_for(self.pub.recv(), timeout))[:1] == b"\x00":
            continue
        assert message[:1] == b"\x01", message

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    async def _serve_replays(self) -> None:
        while True:
            identity, delimiter, start = await self.router.recv_multipart()
            assert delimiter == b""
            self.requests.append(int.from_bytes(start, "big"))
            self.request_seen.set()
            if self.mute:
                continue
            await self.release.wait()
            for seq, topic, payload in self.buffer:
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart(
                        [identity, b"", *self._frames(topic, seq.to_bytes(8, "big"), payload)]
                    )
            await self.router.send_multipart([identity, b"", *self._frames("", END, b"")])

    def _frames(self, topic: str, seq: bytes, payload: bytes) -> list[bytes]:
        return [topic.encode(), seq, payload] if self.topic_frame else [seq, payload]

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.pub.close(linger=0)
        self.router.close(linger=0)
