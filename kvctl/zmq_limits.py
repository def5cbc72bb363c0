"""The largest ZMQ message kvctl takes from a peer, and what becomes of a connection that sent a larger one.

Without a limit, libzmq takes in a frame of any size before anyone sees it: ten 256 MiB frames on an engine's PUB
took a router to a 1.98 GB peak (issue 36). With `ZMQ_MAXMSGSIZE` it reads each frame's length first and drops
the connection instead, before allocating. It then never makes that connection again: a connecting socket's
session ends on a protocol error, where it retries a lost connection at once and says so (`EVENT_CONNECT_RETRIED`).
So whoever holds the socket watches its monitor (`watch`, or `Drops` in a loop of its own): a disconnect that no
retry follows within `RETRY_WAIT_S` was such a drop, counted and connected again (`reconnect`); what the peer sent
meanwhile is a gap its sequence numbers show, as any other.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Generic, TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

MAX_MESSAGE_BYTES = 64 << 20
"""A frame's most by default, 64 MiB (as `--max-body-bytes`): an engine's batch is one scheduler step's blocks, a
few MB even at 128k tokens a step (a token id is up to 5 bytes), and a batch of 100,000 stored events of 16 tokens
each is 17 MB."""

RETRY_WAIT_S = 1.0
"""How long after a disconnect libzmq's retry may take to be announced before the connection counts as dropped
for good: its I/O thread announces it microseconds after the disconnect; a second is past any stall of it."""

WATCHED = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_HANDSHAKE_SUCCEEDED
"""The monitor events `Drops` reads (a caller may watch more)."""

S = TypeVar("S", bound="zmq.Socket[Any]")
K = TypeVar("K", bound=Hashable)


def limited(sock: S, max_bytes: int) -> S:
    """`sock` refusing any frame over `max_bytes` from its peers (libzmq drops the connection that sends one)."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    return sock


class Drops(Generic[K]):
    """Which connections libzmq dropped for good, told from monitor events, each connection named by a `K` (its
    endpoint, or its socket's key and endpoint where one watcher reads several monitors). No I/O, no clock: the
    times are passed in. Cheap while nothing is disconnected: a busy loop asks `due` every round."""

    def __init__(self, wait_s: float = RETRY_WAIT_S) -> None:
        self.wait_s = wait_s
        self._unretried: dict[K, float] = {}  # connection -> when the retry that did not come is overdue

    def seen(self, event: int, connection: K, now: float) -> None:
        if event == zmq.EVENT_DISCONNECTED:
            self._unretried[connection] = now + self.wait_s
        elif event & (zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_HANDSHAKE_SUCCEEDED):
            self._unretried.pop(connection, None)

    def due(self, now: float) -> list[K]:
        """The connections now known dropped for good (each told once)."""
        if not self._unretried:
            return []
        gone = [connection for connection, at in self._unretried.items() if at <= now]
        for connection in gone:
            del self._unretried[connection]
        return gone

    def timeout(self, now: float) -> float | None:
        """Seconds until the next connection is due; None when none waits."""
        return None if not self._unretried else max(0.0, min(self._unretried.values()) - now)


def waiting_events(monitor: zmq.Socket[Any]) -> Iterator[tuple[int, str]]:
    """Each (event, endpoint) waiting on a (blocking) monitor socket, read without waiting for more."""
    while monitor.poll(0):
        message = parse_monitor_message(monitor.recv_multipart())
        yield message["event"], message["endpoint"].decode()


def reconnect(sock: zmq.Socket[Any], endpoint: str) -> None:
    """Connect `sock` to `endpoint` again, after libzmq dropped the connection and forgot it."""
    with contextlib.suppress(zmq.ZMQError):  # the endpoint is still listed (it is, in libzmq 4.3): let it go first
        sock.disconnect(endpoint)
    sock.connect(endpoint)


async def watch(sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket, dropped: Callable[[str], None],
                seen: Callable[[int], None] | None = None) -> None:
    """Read `sock`'s monitor until cancelled: each connection libzmq dropped for good is made again, then
    `dropped(endpoint)` is told; `seen(event)` is told every event first."""
    drops: Drops[str] = Drops()
    loop = asyncio.get_running_loop()
    while True:
        timeout = drops.timeout(loop.time())
        if await monitor.poll(None if timeout is None else int(timeout * 1000) + 1):
            message = parse_monitor_message(await monitor.recv_multipart())
            event = message["event"]
            drops.seen(event, message["endpoint"].decode(), loop.time())
            if seen is not None:
                seen(event)
        for endpoint in drops.due(loop.time()):
            reconnect(sock, endpoint)
            dropped(endpoint)
