"""The router client for commands: blocking, one keep-alive connection."""

from __future__ import annotations

from typing import Any

import httpx

from kvctl.client._base import Call, headers, interpret, pool_limits, translate, verify_tls


class RouterClient:
    def __init__(self, base_url: str, *, token: str | None = None, timeout: float = 5.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = base_url
        self._http = httpx.Client(base_url=base_url, headers=headers(token), timeout=timeout, transport=transport,
                                  limits=pool_limits(), verify=verify_tls(base_url))

    def send(self, call: Call) -> Any:
        with translate(self.base_url):
            response = self._http.request(call.method, call.path, params=call.params, json=call.json)
        return interpret(call, response)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RouterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
