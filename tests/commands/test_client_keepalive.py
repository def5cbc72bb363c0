"""kvctl's HTTP clients drop an idle pooled connection before the server on the other end would close it.

uvicorn (vLLM's, SGLang's and the mock engines' server) closes an idle keep-alive connection after 5 s, and
httpx's pool kept one for 5 s too: a request sent on it at that moment failed with "Server disconnected
without sending a response" (a `kvctl demo` run in CI lost one request to it). The server here is a plain
socket server that counts the connections it accepts and never closes one itself.
"""

from __future__ import annotations

import asyncio

import uvicorn

from kvctl.client import calls
from kvctl.client._base import KEEPALIVE_EXPIRY_S
from kvctl.client.aio import AsyncRouterClient
from kvctl.client.engine import EngineClient
from kvctl.client.sync import RouterClient
from kvctl.server.http.route_protocol import IDLE_TIMEOUT_S

ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 14\r\n\r\n{\"workers\":[]}"
"""A router's answer to `GET /v1/workers` (and an engine's to anything: its client reads none)."""


class CountingServer:
    def __init__(self) -> None:
        self.connections = 0
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            writer.write(ANSWER)
            await writer.drain()
        writer.close()


async def test_the_async_router_client_reuses_a_busy_connection_and_drops_an_idle_one() -> None:
    counting = CountingServer()
    async with counting as url, AsyncRouterClient(url) as client:
        await client.send(calls.workers())
        await client.send(calls.workers())
        assert counting.connections == 1  # keep-alive works
        await asyncio.sleep(KEEPALIVE_EXPIRY_S + 0.3)
        await client.send(calls.workers())
        assert counting.connections == 2  # the idle one was not reused


async def test_the_engine_client_drops_an_idle_connection_too() -> None:
    counting = CountingServer()
    async with counting as url:
        engine = EngineClient(url)
        try:
            await engine.restart()
            await asyncio.sleep(KEEPALIVE_EXPIRY_S + 0.3)
            await engine.restart()
        finally:
            await engine.aclose()
    assert counting.connections == 2


def test_the_sync_client_expires_idle_connections_and_servers_outlive_client_pools() -> None:
    client = RouterClient("http://127.0.0.1:9")
    try:
        pool = client._http._transport._pool  # type: ignore[attr-defined]
        assert pool._keepalive_expiry == KEEPALIVE_EXPIRY_S
    finally:
        client.close()
    server_default = uvicorn.Config(app=None).timeout_keep_alive
    assert server_default > KEEPALIVE_EXPIRY_S  # engines on uvicorn's default never close first
    assert IDLE_TIMEOUT_S > 15  # kvctl serve outlives aiohttp's 15 s and httpx's 5 s pools
