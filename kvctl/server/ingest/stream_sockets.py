"""The sockets of one engine stream (`zmq_source.EngineStream`): its SUB, unless the decode process receives for
it, and its replay DEALER, registered with one poller while the stream runs. Apart from the stream's sequencing,
which reads them but never opens or closes one itself.

Both refuse frames over `max_bytes` (`kvctl.zmq_limits`). The SUB's monitor is watched: a connection libzmq dropped
for a frame over it is made again and `on_dropped` told. A DEALER so dropped needs no watching: its replay times
out, and the stream opens a fresh DEALER for the next one."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import zmq
import zmq.asyncio

from kvctl.server.ingest.decode_process.parent import Decoder, Subscription
from kvctl.zmq_limits import WATCHED, limited, watch


class StreamSockets:
    """`context`: where sockets are made (the process-wide one by default); `decoder`: asked to receive for the
    stream (`key`, None while the stream reads its own `sub`)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str, rcvhwm: int,
                 context: zmq.asyncio.Context | None, decoder: Decoder, max_bytes: int,
                 on_dropped: Callable[[], None]) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.rcvhwm = rcvhwm
        self.max_bytes = max_bytes
        self.on_dropped = on_dropped
        self._context = context
        self._decoder = decoder
        self.sub: zmq.asyncio.Socket | None = None
        self._watching: asyncio.Task[None] | None = None  # the SUB's monitor
        self._monitor: zmq.asyncio.Socket | None = None
        self.sub_sync: zmq.Socket[bytes] | None = None  # the same socket, read without a future per message
        self.dealer: zmq.asyncio.Socket | None = None
        self.poller: zmq.asyncio.Poller | None = None
        self.key: int | None = None  # while the decode process receives for the stream

    def _ctx(self) -> zmq.asyncio.Context:
        if self._context is None:
            self._context = zmq.asyncio.Context.instance()
        return self._context

    def open(self, subscription: Subscription) -> None:
        """The poller, the decode process asked to receive (`subscription`), and the DEALER when there is a replay."""
        self.poller = zmq.asyncio.Poller()
        self.key = self._decoder.receive(subscription)
        if self.replay_endpoint is not None:
            self.open_dealer()

    def open_sub(self) -> None:
        assert self.poller is not None
        sub = limited(self._ctx().socket(zmq.SUB), self.max_bytes)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.rcvhwm)
        sub.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        self.sub = sub
        self.sub_sync = zmq.Socket.shadow(sub.underlying)
        self.poller.register(sub, zmq.POLLIN)
        self._monitor = sub.get_monitor_socket(WATCHED)
        self._watching = asyncio.get_running_loop().create_task(watch(sub, self._monitor, lambda _: self.on_dropped()))
        sub.connect(self.endpoint)

    def open_dealer(self) -> None:
        assert self.replay_endpoint is not None and self.poller is not None
        dealer = limited(self._ctx().socket(zmq.DEALER), self.max_bytes)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        self.dealer = dealer
        self.poller.register(dealer, zmq.POLLIN)

    def reset_dealer(self, *, reopen: bool) -> None:
        """Close the DEALER, and with `reopen` open a fresh one, so replies of an abandoned replay can never be
        taken for a later one's."""
        if self.dealer is not None:
            if self.poller is not None:
                self.poller.unregister(self.dealer)
            self.dealer.close(linger=0)
            self.dealer = None
        if reopen and self.replay_endpoint is not None and self.poller is not None:
            self.open_dealer()

    def close(self) -> None:
        if self.key is not None:
            self._decoder.stop_receiving(self.key)
            self.key = None
        if self._watching is not None:
            self._watching.cancel()
            self._watching = None
        if self._monitor is not None and self.sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sub.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        for sock in (self.sub, self.dealer):
            if sock is not None:
                sock.close(linger=0)
        self.sub = self.dealer = self.sub_sync = None
        self.poller = None
