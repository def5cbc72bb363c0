"""The router's listening socket, bound before the server's code is loaded: the port opens at once, and
connections wait in its backlog the half second or so it takes `kvctl serve` to load uvicorn, the HTTP app and
the ingest, instead of being refused (issue 27: the port opens in under a second, whatever the index size)."""

from __future__ import annotations

import ipaddress
import socket

from kvctl.errors import CannotListen


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only for TCP-typed listeners;
    # without it each keep-alive response waits ~40 ms on the client's delayed ACK (Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise CannotListen(address, exc.strerror or str(exc)) from None
    sock.set_inheritable(True)
    return sock


def base_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
