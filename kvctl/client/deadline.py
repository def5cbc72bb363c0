"""A deadline for a whole HTTP call, not for each read: `--timeout` bounds what a script (or Nagios) waits.

httpx's timeouts apply to each connect, read and write, so a server that trickles a byte a second never
trips one. A deadline here is a monotonic instant in a context variable, set around one call (by the
clients) or around a whole command (`within`, as `kvctl doctor` does). The blocking clients' sockets go
through `DeadlineBackend`, whose every connect, read and write waits at most until that instant, and then
fails as httpx's own timeouts do. The async client runs its calls under `asyncio.timeout_at` that instant.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import httpcore
import httpx

_DEADLINE: ContextVar[float | None] = ContextVar("kvctl_http_deadline", default=None)


@contextmanager
def within(seconds: float) -> Iterator[float]:
    """Every call made inside ends `seconds` from now at the latest (sooner if an enclosing deadline says so);
    yields the deadline (a `time.monotonic()` instant, which is also asyncio's loop clock)."""
    outer = _DEADLINE.get()
    ends = time.monotonic() + seconds if outer is None else min(time.monotonic() + seconds, outer)
    token = _DEADLINE.set(ends)
    try:
        yield ends
    finally:
        _DEADLINE.reset(token)


def _bounded(timeout: float | None, expired: type[Exception]) -> float | None:
    """`timeout`, shortened to what is left of the deadline; `expired` raised once nothing is left."""
    ends = _DEADLINE.get()
    if ends is None:
        return timeout
    left = ends - time.monotonic()
    if left <= 0:
        raise expired("the deadline for the whole call passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _bounded(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _bounded(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._stream.start_tls(ssl_context, server_hostname,
                                                      _bounded(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's blocking sockets, each wait bounded by the current deadline."""

    def __init__(self, backend: httpcore.NetworkBackend) -> None:
        self._backend = backend

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._backend.connect_tcp(host, port, _bounded(timeout, httpcore.ConnectTimeout),
                                                         local_address, socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._backend.connect_unix_socket(path, _bounded(timeout, httpcore.ConnectTimeout),
                                                                 socket_options))

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


def deadline_transport(*, verify: bool, limits: httpx.Limits) -> httpx.HTTPTransport:
    """httpx's own transport whose connections use `DeadlineBackend`. httpx takes no network backend, so it is
    set on the transport's pool before any connection exists (tests/commands/test_deadline.py fails if it
    stops working)."""
    transport = httpx.HTTPTransport(verify=verify, limits=limits)
    pool = transport._pool  # noqa: SLF001 - see the docstring
    pool._network_backend = DeadlineBackend(pool._network_backend)  # noqa: SLF001
    return transport
