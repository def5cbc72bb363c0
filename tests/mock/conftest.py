"""Mock engines on free loopback ports, and a ZMQ context that the tests close."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import httpx
import pytest
import zmq
import zmq.asyncio

from kvctl.mock.engine import EngineConfig, MockEngine
from kvctl.mock.fleet import Fleet
from tests.support import eventually_async

FAST = {"block_size": 4, "capacity": 64, "speedup": 100.0}
"""Small blocks and cache, and the timing model 100 times faster: a step takes well under a millisecond."""


SocketFactory = Callable[[int], zmq.asyncio.Socket]


@pytest.fixture
def zsock() -> Iterator[SocketFactory]:
    """`zsock(zmq.SUB)`: async ZMQ sockets that are all closed after the test."""
    ctx = zmq.asyncio.Context()
    sockets: list[zmq.asyncio.Socket] = []

    def make(kind: int) -> zmq.asyncio.Socket:
        sockets.append(ctx.socket(kind))
        return sockets[-1]

    yield make
    for sock in sockets:
        sock.close(linger=0)
    ctx.term()


EngineFactory = Callable[..., AbstractAsyncContextManager[MockEngine]]


@pytest.fixture
def mock_engine() -> EngineFactory:
    """`async with mock_engine(**config) as engine:` one started engine with fast test timings."""

    @asynccontextmanager
    async def start(**overrides: object) -> AsyncIterator[MockEngine]:
        async with Fleet([EngineConfig(**{"worker_id": 1, **FAST, **overrides})]) as fleet:
            yield fleet.engines[0]

    return start


async def subscribe(zsock: SocketFactory, engine: MockEngine) -> zmq.asyncio.Socket:
    """A SUB connected to `engine`'s PUB, returned once its subscription has reached the PUB (ZMQ's slow
    joiner): everything the engine publishes from then on arrives."""
    assert engine.publisher is not None, "the engine is not started"
    before = engine.publisher.subscriptions()
    sub = zsock(zmq.SUB)
    sub.subscribe(b"")
    sub.connect(engine.publisher.endpoint)
    await eventually_async(engine.publisher.subscriptions, "our SUB's subscription", until=lambda n: n > before)
    return sub


def metric(text: str, name: str) -> float:
    """The value of an unlabelled-or-labelled sample `name` (exactly one) in Prometheus text."""
    [value] = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, flags=re.MULTILINE)
    return float(value)


async def generate(engine: MockEngine, tokens: list[int], max_tokens: int = 2) -> list[dict]:
    """POST /v1/generate over real HTTP and return the NDJSON lines."""
    async with httpx.AsyncClient(base_url=engine.url) as client:
        response = await client.post("/v1/generate", json={"token_ids": tokens, "max_tokens": max_tokens})
    response.raise_for_status()
    return [json.loads(line) for line in response.text.splitlines()]
