"""The router client for commands: blocking, one keep-alive connection; `timeout` bounds each whole call."""

from __future__ import annotations

import httpx

from kvctl.client._base import Call, T, headers, interpret, pool_limits, request_args, translate, verify_tls
from kvctl.client.deadline import deadline_transport, within


class RouterClient:
    def __init__(self, base_url: str, *, token: str | None = None, timeout: float = 5.0) -> None:
        self.base_url = base_url
        self._timeout = timeout
        self._http = httpx.Client(base_url=base_url, headers=headers(token), timeout=timeout,
                                  transport=deadline_transport(verify=verify_tls(base_url), limits=pool_limits()))

    def send(self, call: Call[T]) -> T:
        with translate(self.base_url), within(self._timeout):
            response = self._http.request(call.method, call.path, **request_args(call))
        return interpret(call, response)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RouterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
