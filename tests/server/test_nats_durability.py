"""JetStream durability end to end: `kvctl serve --jetstream` killed with SIGKILL mid-stream, and the
nats-server itself restarted mid-stream (store dir kept); neither may lose an event."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from kvctl.core.events.dynamo import decode_router_event_json
from kvctl.core.events.plane import PlaneNames
from tests.nats_server import NatsServer
from tests.server.test_nats_plane import Router, dump_blocks, expected_blocks, js_publish, options, workload
from tests.support import eventually, eventually_async


@contextmanager
def serve(nats: NatsServer, names: PlaneNames, state_dir: Path,
          router_id: int) -> Iterator[tuple[subprocess.Popen[str], httpx.Client]]:
    state_dir = state_dir / f"router-{router_id}"  # one router per state dir: each holds its own
    state_dir.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "kvctl", "serve", "--listen", "127.0.0.1:0", "--state-dir", str(state_dir),
           "--nats", nats.url, "--namespace", names.namespace, "--jetstream", "--router-id", str(router_id),
           "--log-level", "info"]
    with (state_dir / "serve.log").open("a") as log, \
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
        try:
            url = proc.stdout.readline().strip()  # type: ignore[union-attr]
            assert url.startswith("http://"), url
            with httpx.Client(base_url=url, timeout=5) as client:
                eventually(lambda: client.get("/v1/status").json()["event_plane"], "the event plane to be ready",
                           until=lambda plane: bool(plane and plane.get("ready")), timeout=15)
                yield proc, client
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def served_blocks(client: httpx.Client) -> dict[tuple[int, int], set[tuple[int | None, int]]]:
    return dump_blocks([decode_router_event_json(e) for e in client.get("/v1/tree").json()])


def wait_for(client: httpx.Client, events: int) -> None:
    """Until the router's event plane has counted `events` events."""
    eventually(lambda: client.get("/v1/status").json()["event_plane"]["counts"].get("events", 0),
               f"{events} events", until=lambda n: n >= events, timeout=20)


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    srv = NatsServer(tmp_path / "nats")
    yield srv
    srv.stop()


def test_a_router_killed_mid_stream_ends_identical_to_one_that_ran_through(nats_server: NatsServer,
                                                                           tmp_path: Path) -> None:
    names = PlaneNames("durable", "backend")
    events = workload(60)
    head, middle, tail = events[:30], events[30:60], events[60:]
    with serve(nats_server, names, tmp_path, router_id=1) as (victim, victim_http), \
            serve(nats_server, names, tmp_path, router_id=2) as (_, witness_http):
        asyncio.run(js_publish(nats_server, names, head))
        wait_for(victim_http, 10)  # part of the head applied, maybe not all of it acked
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        asyncio.run(js_publish(nats_server, names, middle))  # while it is down
        with serve(nats_server, names, tmp_path, router_id=1) as (_, revived_http):
            asyncio.run(js_publish(nats_server, names, tail))
            wait_for(witness_http, len(events))
            wait_for(revived_http, len(events))
            expected = expected_blocks(events)
            for http in (witness_http, revived_http):  # counted, then applied by the index's writer
                eventually(lambda http=http: served_blocks(http), "every event in the index",
                           until=lambda blocks: blocks == expected)


async def test_nats_server_restart_mid_stream_loses_nothing(nats_server: NatsServer) -> None:
    names = PlaneNames("restart", "backend")
    events = workload(40)
    async with Router(options(nats_server, names, jetstream=True)) as router:
        await js_publish(nats_server, names, events[:25])
        await eventually_async(lambda: router.plane.counts["events"] == 25, "the first part")
        nats_server.restart()  # same port, same store dir
        await eventually_async(lambda: router.plane.reconnects >= 1, "the reconnection", timeout=20)
        await js_publish(nats_server, names, events[25:])
        await eventually_async(lambda: router.plane.counts["events"] == len(events), "the rest", timeout=20)
        await router.streams.writer("default").applied()
        assert router.blocks() == expected_blocks(events)
        assert router.plane.status()["state"] == "connected"
