"""Plain routes are answered inside the HTTP protocol, before it hands the connection back to the loop, with
the bytes the app would have answered (the Date header aside); every other request still goes through uvicorn
and the app. Driven through uvicorn's real protocol over an in-memory transport, as uvicorn's own tests do."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from kvctl.server.http import route_protocol
from kvctl.server.http.api import create_app, http_protocol
from kvctl.server.http.route_protocol import missing_internals
from kvctl.server.state import Fleet
from kvctl.server.worker_info import WorkerInfo
from tests.support.served import served

TOKENS = list(range(64))


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 7433)}.get(name, default)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...


def _connection(max_body_bytes: int = 1 << 20, app: Any = None,
                fast_path: bool = True) -> tuple[asyncio.Protocol, _Transport]:
    if app is None:
        fleet = Fleet()
        fleet.register(WorkerInfo(1, 0, "default"))
        app = create_app(fleet, max_body_bytes=max_body_bytes)
    config = uvicorn.Config(app, lifespan="off", proxy_headers=False, server_header=False, log_config=None)
    protocol_class = http_protocol(app, fast_path=fast_path)
    assert not isinstance(protocol_class, str)
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
    transport = _Transport()
    protocol.connection_made(transport)
    return protocol, transport


def _request(path: str, body: bytes, *headers: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "host: router", *headers]
    if not any(h.lower().startswith("transfer-encoding") for h in headers):
        head.append(f"content-length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _without_date(response: bytes) -> bytes:
    return re.sub(rb"date: [^\r]*\r\n", b"", bytes(response))


async def _answer(path: str, body: bytes, *headers: str, fast_path: bool = True) -> tuple[bytes, bool]:
    """(the response, whether it was written before data_received returned)."""
    protocol, transport = _connection(fast_path=fast_path)
    protocol.data_received(_request(path, body, *headers))
    at_once = bool(transport.written)
    for _ in range(50):
        if transport.written.endswith(b"}"):
            break
        await asyncio.sleep(0.01)
    return _without_date(transport.written), at_once


BODIES = [
    json.dumps({"token_ids": TOKENS}).encode(),
    json.dumps({"token_ids": TOKENS, "explain": True}).encode(),
    b"{",
    json.dumps({"token_ids": [1], "local_hashes": [2]}).encode(),
    json.dumps({"token_ids": [-1]}).encode(),
    json.dumps({"model": "nope", "token_ids": TOKENS}).encode(),
]


async def test_plain_routes_are_answered_in_the_protocol_as_the_app_answers_them() -> None:
    for body in BODIES:
        fast, at_once = await _answer("/v1/route", body)
        slow, slow_at_once = await _answer("/v1/route?", body)  # a query string: through the app
        assert at_once and not slow_at_once
        assert fast == slow, body
        assert fast.startswith(b"HTTP/1.1 ") and b"content-type: application/json\r\n" in fast


async def test_other_routes_go_through_the_app() -> None:
    body = json.dumps({"token_ids": TOKENS}).encode()
    for headers in (["expect: 100-continue"], ["transfer-encoding: chunked"]):
        wire = body if "chunked" not in headers[0] else b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        response, at_once = await _answer("/v1/route", wire, *headers)
        assert not at_once and b'"worker_id":1' in response, headers
    protocol, transport = _connection()
    protocol.pause_writing()  # a client that stopped reading: the app's path, which waits for it
    protocol.data_received(_request("/v1/route", body))
    assert not transport.written
    protocol.resume_writing()
    await asyncio.sleep(0.05)
    assert b'"worker_id":1' in transport.written
    protocol, transport = _connection(max_body_bytes=100)  # over the cap: the app's 413
    protocol.data_received(_request("/v1/route", body))
    await asyncio.sleep(0.05)
    assert transport.written.startswith(b"HTTP/1.1 413 ")


async def test_without_the_fast_path_plain_routes_go_through_the_app() -> None:
    for body in BODIES:
        fast, _ = await _answer("/v1/route", body)
        slow, at_once = await _answer("/v1/route", body, fast_path=False)
        assert not at_once and slow == fast, body


async def test_a_uvicorn_without_the_internals_is_served_with_its_h11_protocol(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A uvicorn minor that drops what the fast path overrides costs the fast path, never the router's start."""
    assert missing_internals() is None  # the pinned uvicorn has them all
    monkeypatch.delattr(HttpToolsProtocol, "timeout_keep_alive_handler")
    assert missing_internals() == "HttpToolsProtocol.timeout_keep_alive_handler"
    app = create_app(Fleet())
    with caplog.at_level(logging.WARNING, "kvctl.serve"):
        assert http_protocol(app) == "h11"
    assert [r.getMessage() for r in caplog.records if "lacks HttpToolsProtocol.timeout_keep_alive_handler: "
            "serving with its h11 HTTP protocol" in r.getMessage()] and len(caplog.records) == 1


async def test_a_uvicorn_that_moved_its_protocol_still_answers_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(route_protocol, "HttpToolsProtocol", None)  # as when its import fails
    fleet = Fleet()
    fleet.register(WorkerInfo(1, 0, "default"))
    async with served(create_app(fleet), "fast path") as client:
        r = await client.post("/v1/route", json={"token_ids": TOKENS})
    assert r.status_code == 200 and r.json()["worker_id"] == 1


async def test_keep_alive_and_close_are_kept() -> None:
    protocol, transport = _connection()
    body = json.dumps({"token_ids": TOKENS}).encode()
    protocol.data_received(_request("/v1/route", body) * 2)  # two requests in one read, both answered
    assert transport.written.count(b"HTTP/1.1 200 OK") == 2 and not transport.closed
    idle_timers = [h for h in asyncio.get_running_loop()._scheduled if not h.cancelled()]  # type: ignore[attr-defined]
    assert len(idle_timers) == 1  # one idle timeout armed, not one per answer
    protocol.data_received(_request("/v1/route", body, "connection: close"))
    assert transport.written.count(b"HTTP/1.1 200 OK") == 3 and transport.closed
    assert transport.written.endswith(b"}") and b"connection: close\r\n" in transport.written


async def test_routes_answered_in_the_protocol_are_in_the_metrics_once_written() -> None:
    """Their metrics are recorded after each answer is written (off the client's wait), not left for a scrape."""
    fleet = Fleet()
    fleet.register(WorkerInfo(1, 0, "default"))
    app = create_app(fleet)
    protocol, transport = _connection(app=app)
    body = json.dumps({"token_ids": TOKENS}).encode()
    for _ in range(3):
        protocol.data_received(_request("/v1/route", body))
    assert transport.written.count(b"HTTP/1.1 200 OK") == 3
    registry = app.routing.metrics.registry
    assert registry.get_sample_value("kvctl_route_duration_seconds_count", {"model": "default"}) == 3
    assert registry.get_sample_value("kvctl_route_predicted_hit_rate_count", {"model": "default"}) == 3
