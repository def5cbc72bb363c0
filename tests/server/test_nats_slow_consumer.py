"""A router too slow for its NATS plane (issue 36): what nats-py drops from a full subscription, and what the
server drops by closing a slow consumer's connection, is counted in the ledger, shown in /readyz, /v1/status,
/metrics and doctor, and marks the workers whose KV events were lost; the router keeps going.

The router's event loop is held (as a long decode holds it) by joining a thread that publishes meanwhile, so that
nothing is read until the server has done what the test waits for; the server's monitoring port says when.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from kvctl.commands.router import _plane_rows
from kvctl.core.doctor.checks import diagnose
from kvctl.core.events.plane import PlaneNames
from kvctl.nats.barrier import barrier
from kvctl.server.http.api import create_app
from kvctl.server.plane.nats_losses import PART
from tests.nats_server import NatsServer, free_port
from tests.server.test_nats_plane import Router, connected, envelope, expected_blocks, options, store
from tests.support import eventually_async
from tests.support.eventually import eventually
from tests.support.served import served

MAX_PENDING = 1 << 20  # what the server holds for a subscriber before it closes it as a slow consumer
FILLER = 200_000  # bytes a filler message carries (under the server's max_payload)
ROUTER = "kvctl-router-1"  # the router's connection name (router id 1)


class Monitored(NatsServer):
    """A nats-server with a small `max_pending` and its monitoring port, which says what it did to whom."""

    def __init__(self, store_dir: Path) -> None:
        self.monitor = free_port()
        conf = store_dir / "server.conf"
        conf.write_text(f"max_pending: {MAX_PENDING}\nmax_payload: {FILLER + 1024}\n")
        super().__init__(store_dir, "-c", str(conf), "-m", str(self.monitor))

    def connection(self, name: str, state: str = "open") -> dict[str, Any] | None:
        url = f"http://127.0.0.1:{self.monitor}/connz?state={state}"
        with urllib.request.urlopen(url, timeout=10) as answer:
            found = [c for c in json.load(answer)["connections"] if c.get("name") == name]
        return found[-1] if found else None


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Monitored]:
    srv = Monitored(tmp_path_factory.mktemp("nats"))
    yield srv
    srv.stop()


_namespaces = iter(range(1_000_000))


@pytest.fixture
def names() -> PlaneNames:
    return PlaneNames(f"slow{next(_namespaces)}", "backend")


def holding_the_loop(server: NatsServer, publish: Callable[[nats.NATS], Awaitable[None]]) -> None:
    """Run `publish` on a connection of its own in a thread, and wait for it here: the caller's event loop, the
    router's, reads nothing meanwhile."""
    failed: list[BaseException] = []

    async def run() -> None:
        nc = await nats.connect(server.url)
        try:
            await publish(nc)
            await barrier(nc)
        finally:
            await nc.close()

    def thread() -> None:
        try:
            asyncio.run(run())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            failed.append(exc)

    worker = threading.Thread(target=thread)
    worker.start()
    worker.join(120)
    assert not worker.is_alive(), "the publishing thread did not finish"
    if failed:
        raise failed[0]


def tokens(n: int) -> list[int]:
    return list(range(100 * n, 100 * n + 16))


async def ledger(client: Any) -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
    """/readyz, /v1/status and doctor's findings, as an operator sees them."""
    ready = (await client.get("/readyz")).json()
    status = (await client.get("/v1/status")).json()
    workers = (await client.get("/v1/workers")).json()["workers"]
    return ready, status, diagnose(status, workers, [])


def loss(status: dict[str, Any], cause: str) -> dict[str, Any]:
    [found] = [x for x in status["health"]["losses"] if (x["surface"], x["cause"]) == ("nats", cause)]
    return found


async def test_a_server_drop_of_a_slow_router_is_counted_and_marks_the_worker(server: Monitored,
                                                                            names: PlaneNames) -> None:
    """The server closes the router's connection once it holds more than `max_pending` for it; the messages
    published before the router is back are lost. Their count comes from the publisher's next message."""
    before = [store(5, n, tokens(n)) for n in (1, 2, 3)]
    lost = [store(5, n, tokens(n)) for n in range(4, 11)]
    after = store(5, 11, tokens(11))
    async with Router(options(server, names)) as router, connected(server) as nc, \
            served(create_app(router.fleet, plane=router.plane), "asgi") as client:
        for n, ev in enumerate(before, 1):
            await nc.publish(names.kv_events, envelope(ev, n))
        await barrier(nc)
        await eventually_async(lambda: router.plane.counts["events"] == 3, "the first events")

        async def overflow(pub: nats.NATS) -> None:
            for _ in range(1000):  # the kernel's socket buffers first, then max_pending: a few dozen MB at most
                closed = server.connection(ROUTER, "closed")
                if closed is not None and closed["reason"].startswith("Slow Consumer"):
                    break
                for _ in range(8):
                    await pub.publish(f"namespace.{names.namespace}.filler", b"x" * FILLER)
                await barrier(pub)
            else:
                raise AssertionError("the server never dropped the router")
            for n, ev in enumerate(lost, 4):  # the router is gone: these reach nobody
                await pub.publish(names.kv_events, envelope(ev, n))

        holding_the_loop(server, overflow)
        await eventually_async(lambda: router.plane.reconnects == 1, "the router to reconnect", timeout=30)
        assert router.plane.nc is not None
        await barrier(router.plane.nc)  # its subscription is on the server again
        ready, status, _ = await ledger(client)
        assert ready["status"] == "partial"  # lost, but how much is known only once publisher 77 sends again
        assert status["event_plane"]["losses"]["awaiting_publishers"] == 1
        assert status["event_plane"]["losses"]["server_drops"] == 1

        await nc.publish(names.kv_events, envelope(after, 11))
        await barrier(nc)
        await eventually_async(lambda: router.plane.counts["events"] == 4, "the event after the drop")
        await router.streams.writer("default").applied()
        assert router.blocks() == expected_blocks([*before, after])  # it kept going; 4..10 are missing

        ready, status, findings = await ledger(client)
        assert loss(status, "slow_consumer")["count"] == 7
        assert status["event_plane"]["losses"]["gapped"] == {"5:0": 7}
        shown = {row["field"]: row["value"] for row in _plane_rows(status["event_plane"])}  # kvctl router status
        assert (shown["losses"], shown["gapped workers"]) == (
            "disconnects=1, events_lost=7, messages_lost=7, server_drops=1", "5:0=7")
        assert ready["status"] == "partial" and ready["faults"][0].startswith(f"{PART}: worker 5:0 lost KV events")
        metrics = (await client.get("/metrics")).text
        assert 'kvctl_input_lost_total{cause="slow_consumer",surface="nats"} 7.0' in metrics
        assert f'kvctl_part_down{{blocks_ready="false",part="{PART}"}} 1.0' in metrics
        found = {f.check: f for f in findings}
        assert "slow consumer" in found["lost:nats"].cause and "max_pending" in found["lost:nats"].next_step
        assert "router reset --worker" in found[f"part:{PART}"].next_step

        await client.post("/v1/reset", json={"worker_id": 5})  # the operator resyncs the worker
        ready, _, _ = await ledger(client)
        assert ready["status"] == "ready"


async def test_what_nats_py_drops_from_a_full_subscription_is_counted(server: Monitored, names: PlaneNames) -> None:
    """Twenty messages arrive at once for a subscription that holds four: nats-py drops sixteen, each counted as
    it drops it; the gap the publisher's next message shows is the same loss, not counted again."""
    before = [store(5, n, tokens(n)) for n in (1, 2, 3)]
    burst = [store(5, n, tokens(n)) for n in range(4, 24)]
    after = store(5, 24, tokens(24))
    async with Router(options(server, names, pending_msgs=4)) as router, connected(server) as nc, \
            served(create_app(router.fleet, plane=router.plane), "asgi") as client:
        for n, ev in enumerate(before, 1):
            await nc.publish(names.kv_events, envelope(ev, n))
        await barrier(nc)
        await eventually_async(lambda: router.plane.counts["events"] == 3, "the first events")
        sent = eventually(lambda: server.connection(ROUTER), "the router's connection")["out_msgs"]

        async def burst_at_once(pub: nats.NATS) -> None:
            for n, ev in enumerate(burst, 4):
                await pub.publish(names.kv_events, envelope(ev, n))
            await barrier(pub)
            eventually(lambda: server.connection(ROUTER), "the whole burst written to the router's socket",
                       until=lambda c: c is not None and c["out_msgs"] >= sent + len(burst) and not c["pending_bytes"])

        holding_the_loop(server, burst_at_once)
        await eventually_async(lambda: router.plane.counts["events"] == 7, "the four messages nats-py held")
        ready, status, _ = await ledger(client)
        assert loss(status, "slow_consumer")["count"] == 16
        assert status["event_plane"]["losses"]["client_drops"] == 16
        assert ready["status"] == "partial"  # whose events were lost is known once the publisher sends again

        await nc.publish(names.kv_events, envelope(after, 24))
        await barrier(nc)
        await eventually_async(lambda: router.plane.counts["events"] == 8, "the event after the drops")
        await router.streams.writer("default").applied()
        assert router.blocks() == expected_blocks([*before, *burst[:4], after])
        ready, status, findings = await ledger(client)
        assert loss(status, "slow_consumer")["count"] == 16  # the gap is the same 16 messages
        assert status["event_plane"]["losses"]["gapped"] == {"5:0": 16}
        assert ready["faults"] == [f"{PART}: worker 5:0 lost KV events: the index may keep blocks they evicted and "
                                   "miss blocks they stored until they are cleared"]
        assert "--nats-pending-msgs" in {f.check: f for f in findings}["lost:nats"].next_step


async def test_a_restarted_server_is_a_lost_connection_not_a_slow_consumer(tmp_path: Path,
                                                                          names: PlaneNames) -> None:
    """A new server id after the reconnect: the messages its publisher skipped are counted as `disconnected`."""
    restarted = NatsServer(tmp_path)
    try:
        async with Router(options(restarted, names)) as router, \
                served(create_app(router.fleet, plane=router.plane), "asgi") as client:
            async with connected(restarted) as nc:
                await nc.publish(names.kv_events, envelope(store(5, 1, tokens(1)), 1))
                await barrier(nc)
            await eventually_async(lambda: router.plane.counts["events"] == 1, "the first event")
            restarted.restart()
            await eventually_async(lambda: router.plane.reconnects == 1, "the router to reconnect", timeout=30)
            assert router.plane.nc is not None
            await barrier(router.plane.nc)
            async with connected(restarted) as nc:  # envelopes 2..4 went out while the server was down
                await nc.publish(names.kv_events, envelope(store(5, 5, tokens(5)), 5))
                await barrier(nc)
            await eventually_async(lambda: router.plane.counts["events"] == 2, "the event after the restart")
            ready, status, _ = await ledger(client)
            assert loss(status, "disconnected")["count"] == 3
            assert status["event_plane"]["losses"]["server_drops"] == 0
            assert [x["cause"] for x in status["health"]["losses"]] == ["disconnected"]
            assert ready["status"] == "partial"
    finally:
        restarted.stop()
