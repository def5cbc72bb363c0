"""`kvctl top` against real routers: a `kvctl serve` process that goes away and comes back, and one fed by
mock engines publishing real vLLM-format ZMQ events while a load generator routes requests through it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from click.testing import Result

from kvctl.client import AsyncRouterClient
from kvctl.client.engine import EngineClient
from kvctl.errors import ApiError
from kvctl.mock.engine import EngineConfig
from kvctl.mock.fleet import Fleet as EngineFleet
from kvctl.mock.load import LoadGenerator, Policy, register_engines, shared_prefix
from kvctl.tui.app import TopApp
from kvctl.tui.frame import Frame, FrameBuilder
from kvctl.tui.sources import NO_AUDIT, LiveSource
from tests.commands.live_router import DUMP, WORKERS, free_port_url, kvctl, loaded_router, url_of
from tests.server.test_serve_process import serving
from tests.support import eventually_async, joined
from tests.tui.test_pilot import SIZE, header_text

ENGINES = 4
SETTLE_S = 10.0


def live(url: str, transport: httpx.AsyncBaseTransport | None = None) -> LiveSource:
    return LiveSource(AsyncRouterClient(url, timeout=2.0, transport=transport), timeout=2.0)


class _AuditAnswers(httpx.AsyncBaseTransport):
    """The real router, but `GET /v1/audit` answered with `status`: 404 as a router from before the audit does
    (Starlette's plain "Not Found" for a path it has no route for), or a failure."""

    def __init__(self, status: int) -> None:
        self.status = status
        self._real = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/audit":
            return httpx.Response(self.status, text="Not Found" if self.status == 404 else "boom")
        return await self._real.handle_async_request(request)

    async def aclose(self) -> None:
        await self._real.aclose()


async def test_a_router_without_the_audit_leaves_the_frame_live_and_says_so_and_a_failing_audit_fails_the_poll(
        tmp_path: Path) -> None:
    with loaded_router(tmp_path) as client:
        url = url_of(client)
        own = live(url)
        audited = await own.poll()
        await own.aclose()
        older = live(url, _AuditAnswers(404))
        poll = await older.poll()
        await older.aclose()
        broken = live(url, _AuditAnswers(500))
        with pytest.raises(ApiError, match="HTTP 500"):  # as a failing /v1/status or /v1/workers would
            await broken.poll()
        await broken.aclose()
    assert audited.audit is not None and audited.audit["decisions"] == 0 and audited.audit_note is None
    assert (poll.audit, poll.audit_note) == (None, NO_AUDIT)
    frame = FrameBuilder(url).update(poll)
    assert {w.key for w in frame.workers} == WORKERS and frame.audit_note == NO_AUDIT


async def test_a_router_that_goes_away_leaves_its_last_frame_marked_stale_until_it_returns(tmp_path: Path) -> None:
    url = free_port_url()
    listen = url.removeprefix("http://")
    with serving(tmp_path / "first", "--listen", listen, "--no-restore") as (proc, client):
        client.post("/v1/events", content=DUMP, headers={"content-type": "application/x-ndjson"})
        app = TopApp(live(url), interval=3600.0)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            assert set(app.shown_keys) == WORKERS and app.stale is None
            last = app.frame
            proc.kill()
            proc.wait()
            await app.refresh_frame()
            assert app.stale is not None and "cannot reach the router" in app.stale
            assert "✕ stale" in header_text(app)
            assert app.frame is last and set(app.shown_keys) == WORKERS  # the last frame stays on screen
            await app.refresh_frame()  # still down: said once, not once a poll
            await pilot.pause()
            assert [n.title for n in app._notifications] == ["router unreachable"]

            with serving(tmp_path / "second", "--listen", listen, "--no-restore") as (_, back):
                back.post("/v1/workers", json={"worker_id": 77})
                await app.refresh_frame()
                assert app.stale is None and "● live" in header_text(app)
                assert app.shown_keys == ["77:0"]  # the new router's state, not the old frame's
                await pilot.pause()
                assert [n.title for n in app._notifications] == ["router unreachable", "router back"]


async def _settled(source: LiveSource, builder: FrameBuilder, want: int) -> Frame:
    """Poll until every engine's blocks reached the router's index (their events cross ZMQ asynchronously)."""
    async def frame() -> Frame:
        return builder.update(await source.poll())

    return await eventually_async(frame, f"{want} block(s) in the router's index",
                                  until=lambda f: sum(w.blocks for w in f.workers) >= want, timeout=SETTLE_S,
                                  interval=0.3)


async def test_values_move_between_polls_with_mock_engines_and_once_lists_every_worker(tmp_path: Path) -> None:
    configs = [EngineConfig(worker_id=10 + n, model_name="default", block_size=16, capacity=512,
                            speedup=100.0) for n in range(ENGINES)]
    with serving(tmp_path, "--no-restore") as (_, client):
        url = str(client.base_url).rstrip("/")
        async with EngineFleet(configs) as engines, AsyncRouterClient(url) as router:
            await register_engines(router, engines.infos(), "default")
            await joined(engines.engines)  # the router's SUBs, before anything is published
            source = live(url)
            builder = FrameBuilder(url)
            before = builder.update(await source.poll())
            assert {w.key for w in before.workers} == {f"{10 + n}:0" for n in range(ENGINES)}
            assert sum(w.blocks for w in before.workers) == 0

            clients = {e.config.worker_id: EngineClient(e.url) for e in engines.engines}
            load = LoadGenerator(clients, router=router)
            stats = await load.run(shared_prefix(40, prefixes=4, prefix_tokens=128, suffix_tokens=32,
                                                 output_tokens=2), Policy.router, concurrency=4)
            assert stats.completed == 40, stats.errors
            await asyncio.gather(*(c.aclose() for c in clients.values()))
            after = await _settled(source, builder, want=1)

            assert sum(w.blocks for w in after.workers) > 0
            assert after.header.blocks > before.header.blocks and after.header.nodes > before.header.nodes
            assert after.header.routes_per_s is not None and after.header.routes_per_s > 0
            assert after.header.events_per_s is not None and after.header.events_per_s > 0
            assert after.header.predicted_hit_rate is not None and 0 < after.header.predicted_hit_rate <= 1
            assert after.health.streams == ENGINES and after.health.gaps == 0
            await source.aclose()

            once: Result = await asyncio.to_thread(kvctl, url, "top", "--once", "--interval", "0.2", "-o", "json")
            assert once.exit_code == 0, once.output
            frame = json.loads(once.stdout)
            assert sorted(w["name"] for w in frame["workers"]) == sorted(w.key for w in after.workers)
            table: Result = await asyncio.to_thread(kvctl, url, "top", "--once", "--interval", "0.2")
            assert table.exit_code == 0, table.output
            listed = {line.split()[0] for line in table.stdout.splitlines() if line[:1].isdigit()}
            assert listed == {w.key for w in after.workers}
