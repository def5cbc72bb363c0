"""The socket Dynamo's workers stream recovery answers to (recovery.py sends the queries): a worker takes a query,
then connects to the address the query named and streams its answer there (core/events/request_plane.py).

It is a listening socket on the router that any peer can reach, so each of its inputs is bounded: it binds where
`--advertise-host` (else `--listen`) says, not on every interface; a connection must name a pending query in its
first message within HANDSHAKE_TIMEOUT_S; an answer may not stall past IDLE_TIMEOUT_S nor grow past
`--recovery-max-bytes`; at most MAX_CONNECTIONS are open at once. What it refuses is counted in the health ledger
(surface `recovery`). A query that ends (answered, failed, timed out) closes its connection at once: nothing
streams on into a buffer nobody reads.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from dataclasses import dataclass, field

from kvctl.core.events.errors import DecodeError
from kvctl.core.events.request_plane import HANDSHAKE_MAX, ResponseStream, TooLarge, TwoPartReader, handshake_subject
from kvctl.core.words import counted
from kvctl.server.health import Health
from kvctl.server.listen import is_loopback

log = logging.getLogger("kvctl.serve")

HANDSHAKE_TIMEOUT_S = 5.0
"""How long a new connection may take to name its query: a worker sends its handshake as it connects."""
IDLE_TIMEOUT_S = 10.0
"""How long an answer may stall between two reads: a worker writes its dump as one message once it is built."""
MAX_CONNECTIONS = 256
"""Answer connections open at once: four times the queries that may be out at once (recovery.MAX_QUERIES), so
that strangers, each gone within HANDSHAKE_TIMEOUT_S, do not crowd out the answers."""
RECOVERY_MAX_BYTES = 256 << 20
"""One answer's bytes (`--recovery-max-bytes`): a tree dump costs ~100 bytes a block (runs of blocks share an
event; ~270 for an event of one block), so 256 MiB holds 1-2.7 million blocks, past the ~600,000 16-token blocks
of the largest single-GPU KV cache (a 0.5B model on a 141 GB H200)."""
_READ = 1 << 16
_WILDCARDS = ("", "0.0.0.0", "::")
LOSS_FIX = "a peer that is no Dynamo worker is connecting to kvctl's recovery listener: firewall it, or set " \
           "--advertise-host to an address only the workers reach"


class RecoveryFailed(Exception):
    """A query that failed for `cause` (the ledger's label: `timeout`, `closed_early`, `too_large`, ...)."""

    def __init__(self, cause: str, text: str) -> None:
        super().__init__(text)
        self.cause = cause


@dataclass(eq=False)
class Answer:
    """One pending query's answer: the stream as it arrives, and its connection once the worker made it."""

    subject: str
    stream: ResponseStream = field(default_factory=ResponseStream)
    done: asyncio.Future[ResponseStream] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    received: int = 0  # bytes on its connection, the handshake's included
    transport: asyncio.WriteTransport | None = None

    def fail(self, exc: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(exc)

    def close(self) -> None:
        """The query is over: cut its connection now (abort: what the kernel holds is dropped, not read)."""
        if not self.done.done():
            self.done.cancel()
        if self.transport is not None:
            self.transport.abort()


class AnswerListener:
    """The listening socket, and which answer each of its connections carries."""

    def __init__(self, health: Health, *, listen_host: str = "127.0.0.1", advertise_host: str | None = None,
                 max_bytes: int = RECOVERY_MAX_BYTES, handshake_s: float = HANDSHAKE_TIMEOUT_S,
                 idle_s: float = IDLE_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS) -> None:
        """`advertise_host`: where workers are told to connect (bound too when it is an address of this host);
        else `listen_host`'s address, or for a wildcard the address each query leaves from."""
        self.health = health
        self.advertise_host = advertise_host
        self.listen_host = "0.0.0.0" if listen_host in _WILDCARDS else listen_host  # Dynamo advertises IPv4
        self.max_bytes = max_bytes
        self.handshake_s = handshake_s
        self.idle_s = idle_s
        self.max_connections = max_connections
        self.host: str | None = None  # where it is bound, once started
        self.port = 0
        self.stray = 0  # connections that named no query of ours
        self._server: asyncio.Server | None = None
        self._pending: dict[str, Answer] = {}
        self._open: set[asyncio.WriteTransport] = set()

    async def start(self) -> None:
        """Bind: the advertised host if it is an address of this host, else the listen host. An OSError when
        neither can be bound."""
        given = self.advertise_host
        hosts = [self.listen_host] if given is None or given == self.listen_host else [given, self.listen_host]
        for host in hosts:
            try:
                self._server = await asyncio.start_server(self._on_connection, host, 0)
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL or host == hosts[-1]:
                    raise
                log.info("recovery: --advertise-host %s is no address of this host (NAT, a Service?): its answers' "
                         "listener binds %s", host, self.listen_host)
                continue
            self.host, self.port = host, self._server.sockets[0].getsockname()[1]
            log.info("recovery: answers' listener on %s port %d", host, self.port)
            return

    @property
    def started(self) -> bool:
        return self._server is not None

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for transport in list(self._open):
                transport.abort()
            await self._server.wait_closed()
            self._server = None

    def reply_host(self, here: str, worker_host: str) -> str:
        """The host a worker at `worker_host` is told to stream to (`here`: the address kvctl reached it from);
        a RecoveryFailed when the listener is on loopback and the worker is not."""
        assert self.host is not None
        if self.advertise_host is not None:
            return self.advertise_host
        if self.host in _WILDCARDS:
            return here
        if is_loopback(self.host) and not is_loopback(here):
            raise RecoveryFailed("loopback_listener", f"kvctl's answers' listener is on {self.host} (--listen): the "
                                 f"worker at {worker_host} cannot connect back; give --advertise-host ADDRESS")
        return self.host

    def is_self(self, host: str, port: int) -> bool:
        """Whether HOST:PORT names this very listener (on loopback or at an address it was given)."""
        return port == self.port and (is_loopback(host) or host in (self.host, self.advertise_host))

    def expect(self, subject: str) -> Answer:
        """Take the answer streamed under `subject`; `Answer.close` once the query is over, whatever its end."""
        answer = self._pending[subject] = Answer(subject)
        answer.done.add_done_callback(lambda _: self._pending.pop(subject, None))
        return answer

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        transport = writer.transport
        peer = address(*writer.get_extra_info("peername")[:2])
        if len(self._open) >= self.max_connections:
            transport.abort()
            self.health.lose("recovery", "too_many_connections",
                             detail=f"{peer}: {counted(len(self._open), 'answer connection')} already open",
                             fix=LOSS_FIX)
            return
        self._open.add(transport)
        frames = TwoPartReader(HANDSHAKE_MAX)
        try:
            answer = await self._handshake(reader, frames, peer)
            if answer is not None:
                answer.transport = transport
                await self._stream(reader, frames, answer)
        finally:
            self._open.discard(transport)
            transport.abort()

    async def _handshake(self, reader: asyncio.StreamReader, frames: TwoPartReader, peer: str) -> Answer | None:
        """The pending answer the connection's first message names; None (counted) for any other."""
        cause, why, received = "stray_connection", "", 0
        try:
            async with asyncio.timeout(self.handshake_s):
                while (first := frames.take()) is None:
                    chunk = await reader.read(_READ)
                    if not chunk:
                        why = "closed before its first message"
                        break
                    received += len(chunk)
                    frames.push(chunk)
                else:
                    answer = self._pending.get(handshake_subject(first[0]))
                    if answer is not None:
                        answer.received = received
                        frames.limit = self.max_bytes
                        return answer
                    why = "its first message names no query of this router's"
        except TimeoutError:
            cause, why = "handshake_timeout", f"named no query within {self.handshake_s:g} s"
        except (DecodeError, OSError) as exc:
            why = f"its first message is no handshake: {exc}"
        self.stray += 1
        self.health.lose("recovery", cause, detail=f"a connection from {peer} {why}", fix=LOSS_FIX)
        return None

    async def _stream(self, reader: asyncio.StreamReader, frames: TwoPartReader, answer: Answer) -> None:
        """The answer's messages until the worker ends it, the query is over, or a limit is passed."""
        try:
            while not answer.done.done():
                while (message := frames.take()) is not None and not answer.stream.done:
                    answer.stream.take(*message)
                if answer.stream.done:
                    answer.done.set_result(answer.stream)
                    return
                async with asyncio.timeout(self.idle_s):
                    chunk = await reader.read(_READ)
                if not chunk:
                    raise RecoveryFailed("closed_early", "the worker closed its answer's connection after "
                                         f"{answer.received:,} bytes, before the answer was whole")
                answer.received += len(chunk)
                if answer.received > self.max_bytes:
                    answer.fail(_too_large(self.max_bytes))
                    return
                frames.push(chunk)
        except TimeoutError:
            answer.fail(RecoveryFailed("idle", f"the worker's answer stalled: no byte for {self.idle_s:g} s after "
                                               f"{answer.received:,} bytes"))
        except TooLarge:
            answer.fail(_too_large(self.max_bytes))
        except (RecoveryFailed, DecodeError, OSError) as exc:
            answer.fail(exc)


def _too_large(limit: int) -> RecoveryFailed:
    return RecoveryFailed("too_large", f"the worker's answer ran past --recovery-max-bytes ({limit:,} bytes)")


def address(host: str, port: int) -> str:
    """HOST:PORT, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
