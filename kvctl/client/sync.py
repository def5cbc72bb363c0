"""The router client for commands: blocking, one keep-alive connection; `timeout` bounds each whole call."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from kvctl.client._base import Call, T, headers, interpret, pool_limits, request_args, translate, verify_tls, warning_of
from kvctl.client.deadline import deadline_transport, within


class RouterClient:
    """`warn` is given the router's warning (a restore in progress) the first time an answer carries one: a
    command says it once, however many calls it makes."""

    def __init__(self, base_url: str, *, token: str | None = None, timeout: float = 5.0,
                 warn: Callable[[str], None] | None = None) -> None:
        self.base_url = base_url
        self._timeout = timeout
        self._warn = warn
        self._http = httpx.Client(base_url=base_url, headers=headers(token), timeout=timeout,
                                  transport=deadline_transport(verify=verify_tls(base_url), limits=pool_limits()))

    def send(self, call: Call[T]) -> T:
        with translate(self.base_url), within(self._timeout):
            response = self._http.request(call.method, call.path, **request_args(call))
        warn = self._warn
        if warn is not None and (warning := warning_of(response)) is not None:
            self._warn = None
            warn(warning)
        return interpret(call, response)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RouterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
