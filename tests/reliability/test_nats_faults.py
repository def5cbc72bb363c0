"""nats-server SIGKILLed (no goodbye) and started again on the same port and store dir while KV events
flow, in both modes of the event plane (issue 11). Each test prints `FAULT <name> lost=<n> ...`.

- JetStream: the publisher retries until the stream has stored each event (that is what its ack
  means), the router's durable consumer picks up where it was: the index ends holding every event.
- NATS Core: no storage anywhere. What is published while the server is down goes nowhere; the router
  reconnects, sees the jump in event ids, and counts exactly those events lost, and nothing else is.

tests/server/test_nats_durability.py already restarts the server under JetStream, but gracefully
(SIGTERM) and with the publisher idle meanwhile; these kill it outright, mid-flow, in both modes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import nats.errors
import nats.js.errors
import pytest

from kvctl.core.events import RouterEvent
from kvctl.core.events.dynamo import encode_router_event_json
from kvctl.core.events.plane import PlaneNames, PlaneScope
from kvctl.nats.barrier import barrier
from tests.nats_server import NatsServer, free_port
from tests.server.test_nats_plane import Router, envelope, expected_blocks, options, store
from tests.support import eventually_async

WORKER = 1


class KillableNats(NatsServer):
    """The test server with its monitoring port on, and a SIGKILL instead of a clean stop."""

    def __init__(self, store_dir: Path) -> None:
        self.monitor = free_port()
        super().__init__(store_dir, "-m", str(self.monitor))

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.proc = None

    def subscribed(self, client_name: str, subject: str) -> bool:
        """Whether the server has processed `client_name`'s subscription to `subject` (its own word for it)."""
        conns = httpx.get(f"http://127.0.0.1:{self.monitor}/connz", params={"subs": "1"}, timeout=2).json()
        return any(c.get("name") == client_name and subject in c.get("subscriptions_list", [])
                   for c in conns.get("connections") or [])


@pytest.fixture
def server(tmp_path: Path) -> Iterator[KillableNats]:
    srv = KillableNats(tmp_path / "nats")
    yield srv
    srv.stop()


def events(first: int, last: int) -> list[RouterEvent]:
    """Event ids first..last of one worker, each storing a prompt of its own (4 blocks)."""
    return [store(WORKER, n, list(range(1000 * n, 1000 * n + 64))) for n in range(first, last + 1)]


def blocks_of(evs: list[RouterEvent]) -> set[tuple[int | None, int]]:
    return expected_blocks(evs).get((WORKER, 0), set())


async def test_core_nats_server_sigkill_loses_exactly_what_was_published_while_it_was_down(
        server: KillableNats) -> None:
    names = PlaneNames("corekill", "backend")
    before, down, after = events(1, 20), events(21, 30), events(31, 50)
    # pending_size=0: a publisher that is not connected fails at once instead of buffering for later, so
    # "published while the server was down" is exactly what it could not hand to any server.
    pub = await nats.connect(server.url, pending_size=0, max_reconnect_attempts=-1, reconnect_time_wait=0.05)
    try:
        async with Router(options(server, names)) as router:
            for n, ev in enumerate(before, 1):
                await pub.publish(names.kv_events, envelope(ev, n))
                await asyncio.sleep(0.005)  # a flow, not a burst
            await barrier(pub)
            await eventually_async(lambda: router.plane.counts["events"] == len(before), "the events before the kill")

            server.kill()
            await eventually_async(lambda: not pub.is_connected and router.plane.state == "reconnecting",
                                   "both to notice")
            refused = 0
            for n, ev in enumerate(down, len(before) + 1):  # the engine goes on emitting; nothing takes it
                with contextlib.suppress(nats.errors.OutboundBufferLimitError):
                    await pub.publish(names.kv_events, envelope(ev, n))
                    continue
                refused += 1
            assert refused == len(down)

            server.start()  # same port, same store dir
            await eventually_async(lambda: pub.is_connected and router.plane.reconnects >= 1,
                                   "the reconnections", timeout=20)
            subscription = PlaneScope(names.namespace).subscription
            await eventually_async(lambda: server.subscribed("kvctl-router-1", subscription),
                                   "the router's subscription")
            for n, ev in enumerate(after, len(before) + len(down) + 1):
                await pub.publish(names.kv_events, envelope(ev, n))
                await asyncio.sleep(0.005)
            await barrier(pub)
            await eventually_async(lambda: router.plane.counts["events"] == len(before) + len(after),
                                   "the events after")
            await router.streams.writer("default").applied()

            counts = router.plane.counts
            held = router.blocks().get((WORKER, 0), set())
            lost_blocks = blocks_of(before + down + after) - held
            print(f"FAULT nats-core-kill lost={counts['lost_events']} events ({len(lost_blocks)} blocks; "
                  f"{len(down)} published while the server was down, {counts['gaps']} gap)")
            assert (counts["lost_events"], counts["gaps"], counts["restarts"]) == (len(down), 1, 0), counts
            assert lost_blocks == blocks_of(down)  # exactly those, and everything else is there
            assert held == blocks_of(before + after)
            assert router.plane.status()["state"] == "connected"
    finally:
        await pub.close()


async def test_jetstream_nats_server_sigkill_mid_flow_loses_nothing(server: KillableNats) -> None:
    names = PlaneNames("jskill", "backend")
    evs = events(1, 80)
    retries = 0

    async def publish_all() -> None:
        """Each event until the stream has acked it, as a JetStream publisher does: a retry after a lost ack
        may store an event twice, which the router must then ignore."""
        nonlocal retries
        nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.05)
        try:
            js = nc.jetstream()
            for ev in evs:
                while True:
                    try:
                        await js.publish(names.stream_subject, encode_router_event_json(ev), timeout=0.5)
                        break
                    except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
                        retries += 1
                        await asyncio.sleep(0.05)
                await asyncio.sleep(0.01)
        finally:
            await nc.close()

    async with Router(options(server, names, jetstream=True)) as router:
        publisher = asyncio.ensure_future(publish_all())
        try:
            await eventually_async(lambda: router.plane.counts["events"] >= 25, "a part of the flow")
            server.kill()  # mid-flow: the publisher is between two events, or in one
            killed_at = router.plane.counts["events"]
            await eventually_async(lambda: router.plane.state == "reconnecting", "the router to notice")
            await eventually_async(lambda: retries >= 2, "the publisher to fail against the dead server")
            server.start()
            await eventually_async(lambda: router.plane.reconnects >= 1, "the reconnection", timeout=20)
            await asyncio.wait_for(publisher, 60)
            await eventually_async(lambda: router.plane.counts["events"] == len(evs), "every event", timeout=20)
            await router.streams.writer("default").applied()
        finally:
            publisher.cancel()
            await asyncio.gather(publisher, return_exceptions=True)
        counts = router.plane.counts
        held = router.blocks().get((WORKER, 0), set())
        lost = blocks_of(evs) - held
        print(f"FAULT nats-jetstream-kill lost={counts.get('lost_events', 0)} events ({len(lost)} blocks; killed "
              f"after {killed_at} of {len(evs)} events, {retries} publish retries, "
              f"{counts.get('stale_events', 0)} redelivered or duplicate events ignored)")
        assert counts.get("lost_events", 0) == 0 and counts.get("restarts", 0) == 0, counts
        assert held == blocks_of(evs)
        assert router.plane.status()["state"] == "connected"
