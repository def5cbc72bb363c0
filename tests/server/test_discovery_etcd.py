"""A real etcd as a hostile discovery store (issue 36): a value of 40 MB, read by a real `kvctl serve`, is
skipped and counted at a bounded cost; an etcd that trickles its answers (a TCP proxy here that forwards them a
byte at a time) fails each call at its deadline, is retried, and raises the plane's fault, which blocks readiness
while no publisher is connected, is only partial while one is, and clears once etcd answers again."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from kvctl.core.doctor.checks import diagnose
from kvctl.core.doctor.findings import Severity
from kvctl.server.http.api import create_app
from kvctl.server.ingest.streams import Streams
from kvctl.server.plane import etcd_discovery
from kvctl.server.plane.zmq_plane import ZmqOptions, ZmqPlane
from kvctl.server.state import Fleet
from tests.etcd_server import EtcdServer
from tests.server.discovery_router import Publisher, channel_record, router, wait_for
from tests.support import eventually_async
from tests.support.served import served

BIG = 40 << 20
PEAK_RSS_MB = 130
"""The router's peak RSS while etcd holds two 40 MB values: about 50 MB at rest, and a range reads at most a
page's cap (about 11 MB) before it halves; each value read whole, in base64 and decoded, cost over 150 MB."""


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path_factory.mktemp("etcd"), "--max-request-bytes", str(64 << 20))  # takes the values
    yield server
    server.stop()


@pytest.fixture
def publisher(etcd: EtcdServer) -> Iterator[Publisher]:
    p = Publisher(1)
    etcd.put(p.key, p.record)
    yield p
    p.close()
    etcd.delete_prefix("v1/")


@pytest.mark.parametrize("size", [2 << 20, pytest.param(BIG, marks=pytest.mark.slow)])
def test_a_huge_value_is_skipped_counted_and_costs_no_memory(tmp_path: Path, etcd: EtcdServer,
                                                             publisher: Publisher, size: int) -> None:
    """2 MB shows the cap (a record is refused past 64 KiB); 40 MB the memory bound (each put takes seconds)."""
    etcd.put(channel_record(2, "tcp://127.0.0.1:9")[0], b"x" * size)  # in the first range
    with router(tmp_path, f"etcd:{etcd.url}") as r:
        wait_for(lambda: r.connected() == {publisher.address}, "the good publisher followed beside it")
        assert r.losses() == {"too_large": 1}
        etcd.put(channel_record(3, "tcp://127.0.0.1:9")[0], b"x" * size)  # seen by the watch: its line too large
        wait_for(lambda: r.losses() == {"too_large": 2}, "the value put meanwhile counted")
        assert r.peak_rss_mb() < PEAK_RSS_MB
        assert r.connected() == {publisher.address} and r.plane()["last_error"] is None
        assert "past 65536 bytes" in str(r.status()["health"]["losses"])


class Trickle:
    """A TCP proxy in front of etcd: requests go through at once; answers, while `slow`, a byte every 20 ms."""

    def __init__(self, upstream: str) -> None:
        self.host, port = upstream.removeprefix("http://").split(":")
        self.port = int(port)
        self.slow = True
        self.url = ""
        self._server: asyncio.Server | None = None
        self._serving: set[asyncio.Task[None]] = set()  # each connection's, cancelled at exit

    async def __aenter__(self) -> Trickle:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._serving:
            task.cancel()
        await asyncio.gather(*self._serving, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._serving.add(task)
        up_writer = None
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
            ahead = asyncio.create_task(self._pump(reader, up_writer, trickle=False))
            try:
                await self._pump(up_reader, writer, trickle=True)
            finally:
                ahead.cancel()
        finally:
            for w in (writer, up_writer):
                if w is not None:
                    w.close()
            self._serving.discard(task)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, trickle: bool) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(1 if trickle and self.slow else 65536):
                writer.write(data)
                await writer.drain()
                if trickle and self.slow:
                    await asyncio.sleep(0.02)


@pytest.fixture
async def trickle(etcd: EtcdServer) -> AsyncIterator[Trickle]:
    async with Trickle(etcd.url) as proxy:
        yield proxy


async def test_a_trickling_etcd_raises_the_fault_until_it_answers_again(
        etcd: EtcdServer, publisher: Publisher, trickle: Trickle, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(etcd_discovery, "CALL_TIMEOUT_S", 1.0)  # the deadline, shortened for the test
    monkeypatch.setattr(etcd_discovery, "WATCH_RENEW_S", 1.0)  # a watch renewed (a range made) every second
    fleet = Fleet(block_size=16, seed=0)
    streams = Streams(fleet)
    plane = ZmqPlane(fleet, streams, ZmqOptions(discovery=f"etcd:{trickle.url}", poll_s=0.05))
    plane.start()
    try:
        async with served(create_app(fleet, streams=streams, plane=plane), "asgi") as client:
            async def ready() -> tuple[int, str]:
                answer = await client.get("/readyz")
                return answer.status_code, answer.json()["status"]

            async def finding() -> Severity | None:
                status = (await client.get("/v1/status")).json()
                found = {f.check: f for f in diagnose(status, [], [])}.get("part:plane.discovery")
                return None if found is None else found.severity

            assert await eventually_async(ready, "blind: readiness refused", until=lambda r: r[0] == 503) == \
                (503, "degraded")
            assert await finding() is Severity.CRITICAL
            fault = fleet.health.faults["plane.discovery"]
            assert "no whole answer within 1 s" in fault.reason and "no publisher of kv-events" in fault.reason
            assert plane.status()["state"] == "listing"

            trickle.slow = False  # etcd answers again: listed, followed, the fault cleared
            await eventually_async(ready, "ready again", until=lambda r: r == (200, "ready"), timeout=30)
            await eventually_async(lambda: any(c["connected"] for c in plane.status()["connections"]),
                                   "the publisher connected")
            assert await finding() is None

            trickle.slow = True  # and trickles again, with a publisher connected: partial, not blind
            await eventually_async(ready, "partial", until=lambda r: r == (200, "partial"), timeout=30)
            assert await finding() is Severity.WARNING
            assert "already connected are still followed" in fleet.health.faults["plane.discovery"].reason
    finally:
        await plane.close()
        await streams.close()
