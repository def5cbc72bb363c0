"""The router's app served by uvicorn in the test's own loop, on a free loopback port, with the route fast path
on or off: the conformance tests run every route test on both paths (`ROUTE_PATHS`, the `route_path` fixture)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import uvicorn

from kvctl.server.http.api import http_protocol
from kvctl.server.listen import bind
from tests.support.eventually import eventually_async

ROUTE_PATHS = ("fast path", "asgi")

on_both_route_paths = pytest.mark.usefixtures("route_path")
"""Marks a test that routes to run on each path (the `route_path` fixture, in conftest.py). Fixtures a mark names
are set up before the test's own, so a `kvctl serve` those start takes the path too."""


def route_on(patch: pytest.MonkeyPatch, path: str) -> None:
    """Sends the routes of every `kvctl serve` started from here on (a process, or the CLI in-process) down
    `path`, by the switch an operator would use (KVCTL_ROUTE_FAST_PATH): no test passes a flag of its own."""
    patch.setenv("KVCTL_ROUTE_FAST_PATH", "1" if path == "fast path" else "0")


@asynccontextmanager
async def served(app: Any, path: str) -> AsyncIterator[httpx.AsyncClient]:
    """A client of `app` served as `kvctl serve` serves it, `path` one of `ROUTE_PATHS`."""
    config = uvicorn.Config(app, http=http_protocol(app, fast_path=path == "fast path"), log_config=None,
                            access_log=False, lifespan="off", proxy_headers=False, server_header=False)
    server = uvicorn.Server(config)
    sock = bind("127.0.0.1", 0)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await eventually_async(lambda: server.started or task.done(), "uvicorn to start")
        host, port = sock.getsockname()[:2]
        # A bulk load of 30,000 events outlasts httpx's 5 s default on a busy machine: only a hang should fail.
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=60) as client:
            yield client
    finally:
        server.should_exit = True
        await task
        sock.close()
