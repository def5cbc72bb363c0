"""POST /v1/route answered inside uvicorn's HTTP protocol, without an ASGI request cycle.

A route is the request a serving fleet makes for every prompt, and its answer is about 120 µs of
Python; what uvicorn adds around it (a scope, a task per request, the ASGI receive and send calls, the
headers and the body written apart) was as much again. For a plain `POST /v1/route` (no query string,
a Content-Length within the body cap, no `Expect: 100-continue`, nothing else in flight on the
connection) this protocol reads the body as the parser hands it over, answers with the same
`_Routing.reply` as the ASGI path, and writes the response in one piece. Every other request, a route
that is none of those included (or one to a client that has stopped reading its answers), goes through
uvicorn and the app as before.

It subclasses uvicorn's httptools protocol, pinned to its minor version in pyproject.toml; the tests
hold its answers to the ASGI path's, headers included.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

__all__ = ["route_protocol"]

log = logging.getLogger("kvctl.serve")

Reply = Callable[[bytes], tuple[int, bytes]]

_ROUTE = b"/v1/route"
_INTERNAL = b'{"error":"internal error while routing; see the router log"}'


def route_protocol(reply: Reply, answered: Callable[[], None], max_body_bytes: int) -> type[HttpToolsProtocol]:
    """uvicorn's protocol class, answering plain routes with `reply` (body bytes -> status, JSON bytes) and
    calling `answered()` once an answer is written (what can wait until the client has its answer)."""

    class RouteProtocol(HttpToolsProtocol):
        _route_body: list[bytes] | None = None  # while a route's body is being read
        _route_keep_alive = True

        def on_message_begin(self) -> None:
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
            if (self.url != _ROUTE or self.expect_100_continue or self.parser.get_method() != b"POST"
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
