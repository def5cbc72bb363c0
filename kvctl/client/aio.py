"""The router client for asyncio code (the TUI, the load generator): the same calls, awaited, each whole
call bounded by `timeout` (a deadline, not a per-read limit: see `kvctl.client.deadline`)."""

from __future__ import annotations

import asyncio

import httpx

from kvctl.client._base import Call, T, headers, interpret, pool_limits, request_args, translate, verify_tls
from kvctl.client.deadline import within


class AsyncRouterClient:
    def __init__(self, base_url: str, *, token: str | None = None, timeout: float = 5.0,
                 transport: httpx.AsyncBaseTransport | None = None, max_connections: int = 100) -> None:
        self.base_url = base_url
        self._timeout = timeout
        self._http = httpx.AsyncClient(base_url=base_url, headers=headers(token), timeout=timeout,
                                       transport=transport, limits=pool_limits(max_connections),
                                       verify=verify_tls(base_url))

    async def send(self, call: Call[T]) -> T:
        with translate(self.base_url), within(self._timeout) as ends:
            async with asyncio.timeout_at(ends):
                response = await self._http.request(call.method, call.path, **request_args(call))
        return interpret(call, response)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncRouterClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
