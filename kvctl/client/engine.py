"""A (mock) engine's request API, as the load generator drives it: one generate call, two moments.

`generate` streams NDJSON: a `first_token` line when prefill is done (with how much of the prompt
was cached), a `done` line at the end. The caller learns both moments, which is what a router needs
to mark prefill complete and then free the request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec

from kvctl.client._base import Request, check, pool_limits, request_args, translate


class EngineClient:
    def __init__(self, base_url: str, *, timeout: float = 60.0, max_connections: int = 64) -> None:
        self.base_url = base_url
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout,
                                       limits=pool_limits(max_connections))

    async def generate(self, token_ids: list[int], max_tokens: int,
                       request_id: str | None = None) -> AsyncIterator[dict[str, Any]]:
        request = Request("POST", "/v1/generate", json={"token_ids": token_ids, "max_tokens": max_tokens,
                                                       "request_id": request_id})
        with translate(self.base_url):
            async with self._http.stream(request.method, request.path, **request_args(request)) as response:
                if not response.is_success:
                    await response.aread()
                    check(request, response)
                async for line in response.aiter_lines():
                    if line.strip():
                        yield msgspec.json.decode(line)

    async def restart(self) -> None:
        """Cold cache and seq from 0, unannounced, as after a crash."""
        await self._post(Request("POST", "/v1/restart"))

    async def clear_cache(self) -> None:
        """Cold cache, announced to the router (AllBlocksCleared) as vLLM's reset_prefix_cache does: what a fair
        comparison between policies starts from, with nothing that looks like a crash."""
        await self._post(Request("POST", "/v1/clear"))

    async def _post(self, request: Request) -> None:
        with translate(self.base_url):
            check(request, await self._http.post(request.path))

    async def aclose(self) -> None:
        await self._http.aclose()
