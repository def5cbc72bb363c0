"""`--format dynamo-nats`: a mock engine publishing as a Dynamo worker does, read by kvctl's event plane."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from kvctl.core.events import Tier
from kvctl.core.events.plane import PlaneNames
from kvctl.mock.engine import EngineConfig, MockEngine
from tests.nats_server import NatsServer
from tests.server.test_nats_plane import Router, options
from tests.support import eventually_async


@pytest.fixture
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    srv = NatsServer(tmp_path_factory.mktemp("nats"))
    yield srv
    srv.stop()


async def _generate(engine: MockEngine, tokens: list[int]) -> None:
    async with httpx.AsyncClient(base_url=engine.url) as http:
        response = await http.post("/v1/generate", json={"token_ids": tokens, "max_tokens": 1})
        assert response.status_code == 200


async def test_dynamo_nats_events_are_ingested_and_match_the_cache_until_cleared(server: NatsServer) -> None:
    names = PlaneNames("mocknats", "backend")
    config = EngineConfig(worker_id=7, capacity=8, format="dynamo-nats", nats_url=server.url,
                          namespace=names.namespace, speedup=100.0)
    async with Router(options(server, names)) as router:
        engine = MockEngine(config)
        await engine.start()
        try:
            for k in range(6):  # 6 prompts of 3 blocks through an 8-block cache: stores and evictions
                await _generate(engine, list(range(100 * k, 100 * k + 48)))
            published = engine.nats.next_id - 1  # type: ignore[union-attr]
            await eventually_async(lambda: router.plane.counts["events"] == published, "every published event")
            await router.streams.writer("default").applied()
            held = {h for blocks in router.blocks().values() for _, h in blocks}
            assert held == engine.cache.contents(Tier.device)
            assert router.plane.errors == {} and router.plane.counts["lost_events"] == 0
            assert engine.info()["endpoint"] is None  # no ZMQ side to register
            engine.clear_cache()  # a Cleared RouterEvent, ids going on: the worker's blocks go, nothing is lost
            await eventually_async(lambda: router.plane.counts["events"] == published + 1, "the Cleared event")
            await router.streams.writer("default").applied()
            assert router.blocks() == {} and router.plane.counts["lost_events"] == 0
        finally:
            await engine.close()
