"""POST /v1/route answered inside uvicorn's HTTP protocol, without an ASGI request cycle.

A route is the request a serving fleet makes for every prompt, and its answer is about 120 µs of
Python; what uvicorn adds around it (a scope, a task per request, the ASGI receive and send calls, the
headers and the body written apart) was as much again. For a plain `POST /v1/route` (no query string,
a Content-Length within the body cap, no `Expect: 100-continue`, nothing else in flight on the
connection) this protocol reads the body as the parser hands it over, answers with the same
`_Routing.reply` as the ASGI path, and writes the response in one piece. Every other request, a route
that is none of those included (or one to a client that has stopped reading its answers), goes through
uvicorn and the app as before.

It is also where every connection's time limits are kept (`Connections`), for both paths: uvicorn
closes a connection idle between requests, but not one that never sends a whole request (a partial
head or body), nor one that stops reading its answer, and each of those held a file descriptor for
ever.

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


@dataclass
class Connections:
    """The limits on client connections (`kvctl serve --idle-timeout`, `--max-connections`) and what they did.

    `idle_timeout_s` bounds the time a connection may keep the router waiting on it: idle between
    requests, sending one request (head and body, from the end of the previous answer), or reading
    nothing of an answer it asked for. It is longer than the pools of common clients keep an idle
    connection (aiohttp 15 s, httpx 5 s), so the server is never the side that closes a connection a
    client is about to reuse. Past `max` open connections a new one is answered 503 and closed at once,
    its request unread (a client that sent one before the answer came may see a reset instead).
    """

    idle_timeout_s: float = IDLE_TIMEOUT_S
    max: int = MAX_CONNECTIONS
    open: int = 0
    refused: int = 0  # over `max`
    timed_out: int = 0  # closed by `idle_timeout_s`: idle, half-sent request, or answer not read

    def refusal(self) -> bytes:
        body = (b'{"error":"too many open connections: %d; the limit is --max-connections"}' % self.max)
        return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))


# What of uvicorn's httptools protocol `RouteProtocol` overrides or reads: methods and class attributes,
# then what its instances set (found among the names its methods assign or read).
_METHODS = ("connection_made", "connection_lost", "_unset_keepalive_if_required", "timeout_keep_alive_handler",
            "pause_writing", "resume_writing", "on_response_complete", "on_message_begin", "on_headers_complete",
            "on_body", "on_message_complete")
_FIELDS = ("cycle", "flow", "server_state", "parser", "transport", "loop", "scope", "url", "headers",
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
                   connections: Connections, *, fast_path: bool = True,
                   readiness: Readiness | None = None) -> type[HttpToolsProtocol]:
    """uvicorn's protocol class, answering plain routes with `reply` (body bytes -> status, JSON bytes) and
    calling `answered()` once an answer is written (what can wait until the client has its answer), with
    the limits of `connections` on every connection. `fast_path=False`: every request goes to the app, as
    every route does while `readiness` says the index is not whole (the app refuses it, with `Retry-After`)."""

    class RouteProtocol(HttpToolsProtocol):
        _route_body: list[bytes] | None = None  # while a route's body is being read
        _route_keep_alive = True
        _counted = False  # in `connections.open` (not refused)
        _receiving = False  # between a request's first byte and its last

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
            # uvicorn types it int, yet only hands it to loop.call_later, which takes seconds as a float.
            self.timeout_keep_alive = connections.idle_timeout_s  # type: ignore[assignment]
            self._wait_on_client()

        def connection_lost(self, exc: Exception | None) -> None:
            if not self._counted:
                return
            connections.open -= 1
            self._counted = False
            self._stop_waiting()
            super().connection_lost(exc)

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
            # uvicorn's own begins the request's ASGI scope, which a route answered here never uses: it
            # is begun once the request turns out to be the app's (`_begin_scope`).
            self.url = b""
            self.expect_100_continue = False
            self.headers = []
            self._route_body = None

        def on_headers_complete(self) -> None:
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
