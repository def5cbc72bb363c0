"""A minimal HTTP/1.1 keep-alive client for load generators that share a small host with the router.

What a benchmark's client spends per request is CPU the router under test does not get. httpx costs a
Python client several hundred microseconds per request (its request and response models, its pool);
this costs tens: one pre-formatted request head, one `sendall`, and a read of exactly the response's
Content-Length. It speaks just enough HTTP for kvctl's own JSON endpoints: no chunked responses, no
redirects, no TLS. It is a load generator, not a client to copy into anything else.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

_HEAD_END = b"\r\n\r\n"


class KeepAlive:
    """One keep-alive connection; `request` returns (status, body). A broken connection raises OSError."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None or parts.port is None:
            raise ValueError(f"need http://HOST:PORT, got {url!r}")
        self._host = f"{parts.hostname}:{parts.port}".encode()
        self._sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = b""

    def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        head = (f"{method} {path} HTTP/1.1\r\nhost: ".encode() + self._host
                + b"\r\ncontent-type: application/json\r\ncontent-length: " + str(len(body)).encode() + _HEAD_END)
        self._sock.sendall(head + body)
        while (end := self._buf.find(_HEAD_END)) < 0:
            self._recv()
        lines = self._buf[:end].split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        length = next((int(line.split(b":", 1)[1]) for line in lines[1:]
                       if line[:15].lower() == b"content-length:"), None)
        if length is None:
            raise OSError(f"response without Content-Length: {lines[0]!r}")
        start = end + len(_HEAD_END)
        while len(self._buf) < start + length:
            self._recv()
        payload, self._buf = self._buf[start:start + length], self._buf[start + length:]
        return status, payload

    def _recv(self) -> None:
        chunk = self._sock.recv(65536)
        if not chunk:
            raise OSError("the server closed the connection")
        self._buf += chunk

    def close(self) -> None:
        self._sock.close()
