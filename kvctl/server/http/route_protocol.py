"""POST /v1/route answered inside uvicorn's HTTP protocol, without an ASGI request cycle.

A route is the request a serving fleet makes for every prompt, and its answer is about 120 µs of
Python; what uvicorn adds around it (a scope, a task per request, the ASGI receive and send calls, the
headers and the body written apart) was as much again. For a plain `POST /v1/route` (no query string,
a Content-Length within the body cap, no `Expect: 100-continue`, nothing else in flight on the
connection) this protocol reads the body as the parser hands it over, answers with the same
`_Routing.reply` as the ASGI path, and writes the response in one piece. Every other request, a route
that is none of those included (or one to a client that has stopped reading its answers), goes through
uvicorn and the app as before.

It is also where every connection's limits are kept (`Connections`), for both paths: uvicorn closes a
connection idle between requests, but not one that never sends a whole request (a partial head or
body), nor one that stops reading its answer, and each of those held a file descriptor for ever; nor
does it bound a request's head, so a client streaming header lines without the blank line grew the
router by 250 MB a second until the idle timeout (a head is now refused past `max_head_bytes` or
`MAX_HEADERS` lines with 431, and past `head_timeout_s` with 408, each counted in the health ledger).

It subclasses uvicorn's httptools protocol, pinned to its minor version in pyproject.toml; the tests
hold its answers to the ASGI path's, headers included, and run every route test on both paths. The
shortcut is a switch (`kvctl serve --no-route-fast-path` sends every route through the app, the
connection limits kept); a uvicorn without the internals it needs (`missing_internals`) gets uvicorn's
own protocol, so an upgrade costs speed, never the start.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import httptools

from kvctl.core.words import counted
from kvctl.server.health import Health
from kvctl.server.readiness import Readiness

try:
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
except ImportError:  # a uvicorn that moved them: `missing_internals` says so and serve goes without
    HttpToolsProtocol = None  # type: ignore[assignment, misc]

__all__ = ["Connections", "missing_internals", "route_protocol"]

log = logging.getLogger("kvctl.serve")

Reply = Callable[[bytes], tuple[int, bytes]]

_ROUTE = b"/v1/route"
_INTERNAL = b'{"error":"internal error while routing; see the router log"}'
IDLE_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 4096
MAX_HEAD_BYTES = 64 * 1024
"""A request head's bytes at most: four times the 16 KiB of h11 or Node (room for long bearer tokens and a proxy's
headers), yet a connection's head is at most that plus one read (256 KiB) in memory."""
MAX_HEADERS = 100
"""Header lines of one request at most (Apache's LimitRequestFields): clients send about ten, and each line costs
some 170 bytes of Python objects, so 64 KiB of short lines alone would hold 2 MB a connection."""
HEAD_TIMEOUT_S = 10.0
"""Seconds from a head's first read to its end at most: a client sends its head in one packet, and this is five
TCP retransmissions of a lost one over; a third of the idle timeout, so a slow head frees its slot sooner."""


@dataclass
class Connections:
    """The limits on client connections (`kvctl serve --idle-timeout`, `--max-connections`) and what they did.

    `idle_timeout_s` bounds the time a connection may keep the router waiting on it: idle between
    requests, sending one request (head and body, from the end of the previous answer), or reading
    nothing of an answer it asked for. It is longer than the pools of common clients keep an idle
    connection (aiohttp 15 s, httpx 5 s), so the server is never the side that closes a connection a
    client is about to reuse. Past `max` open connections a new one is answered 503 and closed at once,
    its request unread (a client that sent one before the answer came may see a reset instead).

    A request's head (request line and headers) is bounded apart, from its first byte: `max_head_bytes`
    (and `MAX_HEADERS` lines) in size, 431, and `head_timeout_s` in time, 408; each answer closes the
    connection, and each refusal is a loss in the health ledger ("http", "head_too_large"/"head_timeout").
    """

    idle_timeout_s: float = IDLE_TIMEOUT_S
    max: int = MAX_CONNECTIONS
    max_head_bytes: int = MAX_HEAD_BYTES
    head_timeout_s: float = HEAD_TIMEOUT_S
    open: int = 0
    refused: int = 0  # over `max`
    timed_out: int = 0  # closed by `idle_timeout_s`: idle, half-sent request, or answer not read

    def refusal(self) -> bytes:
        return closing_answer(503, b"too many open connections: %d; the limit is --max-connections" % self.max)


def closing_answer(status: int, error: bytes) -> bytes:
    """A whole answer, `{"error": ...}` (`error` needs no JSON escaping), after which the connection is closed."""
    body = b'{"error":"%s"}' % error
    return (STATUS_LINE[status] + b"content-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))


@dataclass(frozen=True)
class _HeadRefusal:
    """A refused head's answer, and how the ledger counts it."""

    answer: bytes  # `closing_answer`
    cause: str  # the health ledger's
    flag: str  # what raises the limit


class _HeadRefused(Exception):
    """Raised by a parser callback once a head's refusal is written: the only way to stop httptools' parser."""


class _Parser(httptools.HttpRequestParser):
    """httptools' parser, stopped without an error when a callback refuses a head (`_HeadRefused`): uvicorn
    answers any other error with a 400 and a log line, and the 431 is written already."""

    def feed_data(self, data: bytes) -> None:  # type: ignore[override]
        try:
            super().feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if not isinstance(exc.__context__, _HeadRefused):
                raise


# What of uvicorn's httptools protocol `RouteProtocol` overrides or reads: methods and class attributes,
# then what its instances set (found among the names its methods assign or read).
_METHODS = ("connection_made", "connection_lost", "data_received", "_unset_keepalive_if_required",
            "timeout_keep_alive_handler", "pause_writing", "resume_writing", "on_response_complete",
            "on_message_begin", "on_headers_complete", "on_body", "on_message_complete")
_FIELDS = ("cycle", "flow", "server_state", "parser", "transport", "loop", "scope", "url", "headers", "client",
           "expect_100_continue", "timeout_keep_alive", "timeout_keep_alive_task")


def missing_internals() -> str | None:
    """What the installed uvicorn lacks of the internals the fast path and the connection limits use (None:
    nothing), checked before serving so that a uvicorn that changed them is served around, not crashed on."""
    if HttpToolsProtocol is None:
        return "uvicorn.protocols.http.httptools_impl.HttpToolsProtocol"
    names = {name for value in vars(HttpToolsProtocol).values() if callable(value) and hasattr(value, "__code__")
             for name in value.__code__.co_names}
    missing = [f"HttpToolsProtocol.{m}" for m in _METHODS if not callable(getattr(HttpToolsProtocol, m, None))]
    missing += [f"HttpToolsProtocol().{f}" for f in _FIELDS if f not in names]
    return ", ".join(missing) or None


def route_protocol(reply: Reply, answered: Callable[[], None], max_body_bytes: int,
                   connections: Connections, health: Health, *, fast_path: bool = True,
                   readiness: Readiness | None = None) -> type[HttpToolsProtocol]:
    """uvicorn's protocol class, answering plain routes with `reply` (body bytes -> status, JSON bytes) and
    calling `answered()` once an answer is written (what can wait until the client has its answer), with
    the limits of `connections` on every connection and its refused heads counted in `health`.
    `fast_path=False`: every request goes to the app, as every route does while `readiness` says the index
    is not whole (the app refuses it, with `Retry-After`)."""
    too_large = _HeadRefusal(closing_answer(431, b"request head over %d bytes or %d header lines; the limit is "
                                                 b"kvctl serve --max-head-bytes"
                                                 % (connections.max_head_bytes, MAX_HEADERS)),
                             "head_too_large", "--max-head-bytes")
    too_slow = _HeadRefusal(closing_answer(408, b"request head not sent within %g s; the limit is kvctl serve "
                                                b"--head-timeout" % connections.head_timeout_s),
                            "head_timeout", "--head-timeout")

    class RouteProtocol(HttpToolsProtocol):
        _route_body: list[bytes] | None = None  # while a route's body is being read
        _route_keep_alive = True
        _counted = False  # in `connections.open` (not refused)
        _receiving = False  # between a request's first byte and its last
        # A head's bounds. `_head_bytes`: the open head's bytes up to the last read (0 once it begins at a
        # read's first byte; None once it begins after another request in a read, so that only what was parsed
        # of it is known); `_read_bytes`: the size of the read being parsed. A head that comes in one read
        # (nearly all) costs no timer, and no count unless that read is over the limit.
        _head_open = False
        _head_bytes: int | None = 0
        _read_bytes = 0
        _read_starts_a_head = True  # this read began between requests
        _head_timer: asyncio.TimerHandle | None = None

        # uvicorn's keep-alive timer is the one deadline: started when the router waits on the client (a
        # connection made, an answer written, an answer the client stopped reading), stopped only when a
        # whole request is in, never by a byte of it (uvicorn's is stopped by any data, so a request
        # sent a byte at a time, or never finished, held the connection for ever).

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if connections.open >= connections.max:
                connections.refused += 1
                transport.write(connections.refusal())
                transport.close()
                return
            connections.open += 1
            self._counted = True
            super().connection_made(transport)
            self.parser = _Parser(self)
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)  # as uvicorn sets its own
            # uvicorn types it int, yet only hands it to loop.call_later, which takes seconds as a float.
            self.timeout_keep_alive = connections.idle_timeout_s  # type: ignore[assignment]
            self._wait_on_client()

        def connection_lost(self, exc: Exception | None) -> None:
            if not self._counted:
                return
            connections.open -= 1
            self._counted = False
            self._stop_waiting()
            self._stop_head_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            self._read_bytes = len(data)
            self._read_starts_a_head = not self._receiving
            super().data_received(data)
            if not self._head_open or self.transport.is_closing():
                return
            held = self._head_size() if self._head_bytes is None else self._head_bytes + len(data)
            self._head_bytes = held
            if held > connections.max_head_bytes or len(self.headers) > MAX_HEADERS:
                self._refuse_head(too_large, f"sent {counted(held, 'byte')} and {counted(len(self.headers), 'header')}"
                                  " of a request head without its end")
            elif self._head_timer is None:
                self._head_timer = self.loop.call_later(connections.head_timeout_s, self._head_timed_out)

        def _head_size(self) -> int:
            """The head parsed so far, in bytes (a header line's ": " and CRLF included, the method's not)."""
            return len(self.url) + sum([len(name) + len(value) + 4 for name, value in self.headers])

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self._head_open and not self.transport.is_closing():
                self._refuse_head(too_slow, f"sent {counted(self._head_bytes or 0, 'byte')} of a request head in "
                                  f"{connections.head_timeout_s:g} s without its end")

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _refuse_head(self, refusal: _HeadRefusal, detail: str) -> None:
            self._head_open = False
            self._stop_head_timer()
            peer = f"{self.client[0]}:{self.client[1]} " if self.client else ""
            health.lose("http", refusal.cause, detail=peer + detail, fix="find the client by its address; if it "
                        f"is a legitimate one, raise kvctl serve {refusal.flag}")
            self.transport.write(refusal.answer)
            self.transport.close()

        def _unset_keepalive_if_required(self) -> None:
            """uvicorn stops the clock on any data: here only a whole request does (`_stop_waiting`)."""

        def _wait_on_client(self) -> None:
            self._stop_waiting()
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

        def _stop_waiting(self) -> None:
            if self.timeout_keep_alive_task is not None:
                self.timeout_keep_alive_task.cancel()
                self.timeout_keep_alive_task = None

        def timeout_keep_alive_handler(self) -> None:
            self.timeout_keep_alive_task = None
            working = self.cycle is not None and not self.cycle.response_complete and not self._receiving
            if (working and not self.flow.write_paused) or self.transport.is_closing():
                return  # the app is answering: the clock starts again when it has, or if it is not read
            connections.timed_out += 1
            self.transport.abort()  # nothing is owed to this client; its unread answer is dropped too

        def pause_writing(self) -> None:
            super().pause_writing()
            self._wait_on_client()

        def resume_writing(self) -> None:
            super().resume_writing()
            if not self._receiving and self.cycle is not None and not self.cycle.response_complete:
                self._stop_waiting()  # reading again: the app goes on answering

        def on_response_complete(self) -> None:
            self._stop_waiting()
            super().on_response_complete()  # starts the clock again, unless a pipelined request is next

        def on_message_begin(self) -> None:
            self._receiving = True
            self._head_open = True
            self._head_bytes = 0 if self._read_starts_a_head else None
            self._read_starts_a_head = False
            # uvicorn's own begins the request's ASGI scope, which a route answered here never uses: it
            # is begun once the request turns out to be the app's (`_begin_scope`).
            self.url = b""
            self.expect_100_continue = False
            self.headers = []
            self._route_body = None

        def on_headers_complete(self) -> None:
            self._head_open = False
            self._stop_head_timer()
            could_be_over = (self._head_bytes or 0) + self._read_bytes > connections.max_head_bytes
            if len(self.headers) > MAX_HEADERS or (could_be_over and self._head_size() > connections.max_head_bytes):
                self._refuse_head(too_large, f"sent a request head of {counted(self._head_size(), 'byte')} and "
                                  f"{counted(len(self.headers), 'header')}")
                raise _HeadRefused  # stops the parser (`_Parser`): nothing of this request is read further
            if self._takes_route():
                self._route_body = []
                self._route_keep_alive = self.parser.should_keep_alive()
                return
            self._begin_scope()
            super().on_headers_complete()

        def _begin_scope(self) -> None:
            """uvicorn's `on_message_begin`, keeping what the parser has read since (URL, headers)."""
            url, expect, headers = self.url, self.expect_100_continue, self.headers
            super().on_message_begin()
            self.url, self.expect_100_continue, self.headers = url, expect, headers
            self.scope["headers"] = headers

        def _takes_route(self) -> bool:
            if (not fast_path or (readiness is not None and not readiness.ready) or self.url != _ROUTE
                    or self.expect_100_continue or self.parser.get_method() != b"POST"
                    or self.parser.get_http_version() != "1.1" or self.flow.write_paused
                    or not (self.cycle is None or self.cycle.response_complete)):
                return False  # the app's path: it also waits for a client that does not read its answers
            length = None
            for name, value in self.headers:
                if name == b"transfer-encoding":
                    return False
                if name == b"content-length":
                    if length is not None:
                        return False
                    length = value
            return length is not None and length.isdigit() and int(length) <= max_body_bytes

        def on_body(self, body: bytes) -> None:
            if self._route_body is None:
                super().on_body(body)
            else:
                self._route_body.append(body)

        def on_message_complete(self) -> None:
            self._receiving = False
            if not self.flow.write_paused:
                self._stop_waiting()  # a whole request: now the router owes the answer
            chunks = self._route_body
            if chunks is None:
                super().on_message_complete()
                return
            self._route_body = None
            try:
                status, body = reply(b"".join(chunks))
            except Exception:  # as the ASGI path would: a 500 and a traceback in the log, the server goes on
                log.exception("POST /v1/route failed")
                status, body = 500, _INTERNAL
            head = [STATUS_LINE[status]]
            for name, value in self.server_state.default_headers:
                head += [name, b": ", value, b"\r\n"]
            head.append(b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body))
            keep_alive = self._route_keep_alive
            if not keep_alive:
                head.append(b"connection: close\r\n")
            head += [b"\r\n", body]
            self.transport.write(b"".join(head))
            if not keep_alive:
                self.transport.close()
            self.on_response_complete()
            answered()

    return RouteProtocol
