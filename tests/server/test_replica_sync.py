"""Replica sync is peer input: whatever anyone publishes on a real event plane (a nats-server, or Dynamo's ZMQ sockets)
as another router's in-flight requests reaches only what that router may touch, within caps of the peers' own.

A forged Free or MarkPrefillCompleted reaches only the booking of the router id it names; values past the router's own
limits, workers it does not know, ids it does not trust and bookings past the peers' caps are dropped, each counted
in the health ledger (surface `replica_sync`); and a flood of peers' bookings never refuses this router's own routes
nor grows its memory past the peers' caps.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import nats
import pytest
from typer.testing import CliRunner

from kvctl.cli import app
from kvctl.core.events.dynamo import EnvelopeWriter
from kvctl.core.events.plane import (
    ACTIVE_SEQUENCES,
    FREE,
    PREFILL_COMPLETED,
    ActiveSequenceEvent,
    AddRequest,
    PlaneNames,
    SequenceAction,
    encode_sequence_event,
    encode_sequence_events,
)
from kvctl.core.events.zmq_wire import ZmqMessage, encode_zmq_message
from kvctl.core.router.sequences import ActiveSequences
from kvctl.server.ingest.streams import Streams
from kvctl.server.plane.nats_plane import EventPlane, NatsOptions
from kvctl.server.plane.replica_sync import PeerLimits
from kvctl.server.route_limits import OverLimit, RouteLimits
from kvctl.server.state import Fleet
from kvctl.server.worker_info import WorkerInfo
from tests.nats_server import NatsServer
from tests.server.test_nats_plane import Router, connected, options
from tests.server.test_serve_process import serving
from tests.server.test_zmq_plane import Bench
from tests.support import eventually, eventually_async

_namespaces = itertools.count()
WORKER = (1, 0)
PEER = 99  # another router's id, as its events carry it


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    srv = NatsServer(tmp_path_factory.mktemp("nats"))
    yield srv
    srv.stop()


@pytest.fixture
def names() -> PlaneNames:
    return PlaneNames(f"replica{next(_namespaces)}", "backend")


class Replica(Router):
    """A router with replica sync on the NATS plane, its route limits given, that knows worker 1."""

    def __init__(self, options: NatsOptions, limits: RouteLimits | None = None) -> None:
        self.fleet = Fleet(block_size=16, seed=0, limits=limits)
        self.fleet.register(WorkerInfo(*WORKER, "default"))
        self.streams = Streams(self.fleet)
        self.plane = EventPlane(self.fleet, self.streams, options)

    @property
    def sequences(self) -> ActiveSequences:
        return self.fleet.models["default"].router.sequences

    def lost(self, cause: str) -> int:
        loss = self.fleet.health.losses.get(("replica_sync", cause))
        return 0 if loss is None else loss.count

    async def heard(self, n: int) -> None:
        """Until `n` events of other routers have been taken in (or refused)."""
        await eventually_async(lambda: self.plane.counts["peer_sequence_events"] >= n, f"{n} peers' events")
        assert self.plane.counts["peer_sequence_events"] == n


def event(request_id: str, action: SequenceAction, router_id: int = PEER, worker_id: int = 1) -> ActiveSequenceEvent:
    return ActiveSequenceEvent(request_id, worker_id, 0, action, router_id)


def add(blocks: int, hint: int | None = None) -> AddRequest:
    return AddRequest(list(range(1000, 1000 + blocks)), True, None, hint)


class Anyone:
    """Whoever publishes on the namespace's replica-sync subject: one publisher, any router id in its events."""

    def __init__(self, nc: nats.NATS, names: PlaneNames) -> None:
        self.nc = nc
        self.subject = names.active_sequences
        self.writer = EnvelopeWriter(4242, ACTIVE_SEQUENCES)

    async def send(self, *events: ActiveSequenceEvent | bytes) -> None:
        """Each event as Dynamo's NATS plane carries it, or a payload as it is."""
        for ev in events:
            payload = ev if isinstance(ev, bytes) else encode_sequence_event(ev)
            await self.nc.publish(self.subject, self.writer.wrap(payload, 0))
        await self.nc.flush()


async def test_a_forged_free_or_prefill_complete_leaves_the_booking_of_the_router_that_made_it(
        server: NatsServer, names: PlaneNames) -> None:
    async with Replica(options(server, names, replica_sync=True)) as router, connected(server) as nc:
        router.fleet.route("default", now=time.monotonic(), token_ids=list(range(64)), request_id="r1", reserve=True)
        before = router.sequences.load(WORKER)
        anyone = Anyone(nc, names)
        await anyone.send(event("r1", FREE), event("r1", PREFILL_COMPLETED),  # naming this router's own request
                          event("p1", add(2)), event("p1", add(3)),  # a peer's, booked twice
                          event("p1", FREE, router_id=PEER + 1))  # and freed by another router
        await router.heard(5)
        own = router.sequences.get("r1")
        assert own is not None and not own.prefill_done
        peers = router.sequences.get("p1", owner=PEER)
        assert peers is not None and len(peers.block_hashes) == 2  # the first booking kept
        assert (router.lost("not_owner"), router.lost("duplicate")) == (2, 1)
        assert router.plane.counts["peer_unmatched"] == 1  # another router's free of a request it never booked

        await anyone.send(event("p1", FREE))  # its own router's free reaches it
        await router.heard(6)
        assert router.sequences.get("p1", PEER) is None and router.sequences.load(WORKER) == before
        assert router.fleet.free("default", "r1")


async def test_values_past_the_routers_own_limits_unknown_workers_and_bad_events_are_refused(
        server: NatsServer, names: PlaneNames) -> None:
    async with Replica(options(server, names, replica_sync=True), RouteLimits(max_request_tokens=1024)) as router, \
            connected(server) as nc:
        await Anyone(nc, names).send(
            event("huge-hint", add(2, hint=2**64 - 1)),  # the largest u64 the wire carries
            event("long-prompt", add(65)),  # 1,040 tokens of 16-token blocks
            event("x" * 300, add(1)),  # an id past MAX_REQUEST_ID_CHARS
            event("elsewhere", add(1), worker_id=5),  # a worker this router does not know
            msgspec.msgpack.encode({"request_id": "no-worker", "data": "Free", "router_id": PEER}),
            event("fine", add(64, hint=1024)))  # at the limit: taken
        await router.heard(5)
        (row,) = router.fleet.worker_rows(time.monotonic())  # what /v1/workers and /metrics show
        assert (row.worker_id, row.active_requests, row.active_prefill_tokens) == (1, 1, 1024)
        assert (router.lost("out_of_range"), router.lost("unknown_worker"), router.lost("malformed")) == (3, 1, 1)
        assert list(router.fleet.workers) == [WORKER] and set(router.sequences.loads()) == {WORKER}
        detail = router.fleet.health.losses[("replica_sync", "unknown_worker")].detail
        assert "worker 5:0" in detail and str(PEER) in detail


async def test_peers_have_caps_of_their_own_and_never_take_the_routers_share(
        server: NatsServer, names: PlaneNames) -> None:
    limits = RouteLimits(max_reservations=3, max_reserved_tokens=3 * 4 * 16)
    peers = PeerLimits(max_reserved_tokens=4 * 4 * 16)  # reservations: 3, as the router's own
    async with Replica(options(server, names, replica_sync=True, peer_limits=peers), limits) as router, \
            connected(server) as nc:
        await Anyone(nc, names).send(*(event(f"p{n}", add(4)) for n in range(5)),  # past 3 requests
                                     event("p0", FREE), event("big", add(9)))  # then past 16 blocks' tokens
        await router.heard(7)
        assert (router.sequences.peer_requests, router.sequences.peer_blocks) == (2, 8)
        assert (router.lost("max_peer_reservations"), router.lost("max_peer_reserved_tokens")) == (2, 1)
        for n in range(3):  # the router's own caps are all its own
            router.fleet.route("default", now=time.monotonic(), token_ids=list(range(64)), request_id=f"r{n}",
                               reserve=True)
        with pytest.raises(OverLimit, match="--max-reservations"):
            router.fleet.route("default", now=time.monotonic(), token_ids=list(range(64)), request_id="r3",
                               reserve=True)
        assert router.plane.status()["peers"] == {"trusted": None, "max_peer_reservations": 3,
                                                  "max_peer_reserved_tokens": 256, "requests": 2,
                                                  "reserved_tokens": 128,
                                                  # p0 ended with its blocks in no index: judged, unmatched
                                                  "tracking": {"checked": 1, "matched": 0}}


async def test_only_the_routers_of_replica_peers_are_heard_on_the_zmq_plane(tmp_path: Path) -> None:
    """Dynamo 1.6.1's workers publish MarkPrefillCompleted under their own id as router id: not a router to trust,
    it completes the prefill of the peers' bookings of that request on that worker, never this router's own."""
    bench = Bench(tmp_path / "discovery")  # its router's id is 1
    try:
        publisher = bench.publish_as(ACTIVE_SEQUENCES, 4242)
        bench.fleet.register(WorkerInfo(3, 0, "default"))
        plane = await bench.start(replica_sync=True, shadow=True, peer_limits=PeerLimits(frozenset({7, 8})))
        bench.fleet.route("default", now=time.monotonic(), token_ids=list(range(64)), request_id="r1", reserve=True)
        await publisher.joined()
        writer = EnvelopeWriter(4242, ACTIVE_SEQUENCES)
        batch = [event("r1", add(2), router_id=7, worker_id=3), event("r2", add(2), router_id=PEER, worker_id=3),
                 event("r1", PREFILL_COMPLETED, router_id=3, worker_id=3)]  # from worker 3 itself
        envelope = writer.wrap(encode_sequence_events(batch), 0)
        await publisher.socket.send_multipart(encode_zmq_message(ZmqMessage(ACTIVE_SEQUENCES, 4242, 0, envelope)))
        await eventually_async(lambda: plane.counts["peer_sequence_events"] == 3, "the batch")
        sequences = bench.fleet.models["default"].router.sequences
        peers, own = sequences.get("r1", owner=7), sequences.get("r1")
        assert peers is not None and peers.prefill_done and own is not None and not own.prefill_done
        assert sequences.peer_requests == 1 and plane.counts["worker_prefill_reports"] == 1
        assert {cause: loss.count for (surface, cause), loss in bench.fleet.health.losses.items()
                if surface == "replica_sync"} == {"untrusted_router": 1}
        assert bench.status()["peers"]["trusted"] == [7, 8]
    finally:
        await bench.close()


@pytest.mark.parametrize(("args", "needle"), [
    (["--replica-peers", "7,x"], "--replica-peers wants router ids"),
    (["--replica-peers", str(2**64)], "--replica-peers wants router ids"),
    (["--replica-peers", ","], "--replica-peers wants router ids"),
])
def test_bad_replica_peers_exit_2(args: list[str], needle: str) -> None:
    result = CliRunner().invoke(app, ["serve", "--nats", "nats://127.0.0.1:1", "--replica-sync", *args])
    assert result.exit_code == 2 and needle in result.stderr


def test_peer_flags_need_replica_sync() -> None:
    result = CliRunner().invoke(app, ["serve", "--nats", "nats://127.0.0.1:1", "--max-peer-reservations", "5"])
    assert result.exit_code == 2 and "need --replica-sync" in result.stderr


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


FLOOD = 20_000
BLOCKS = 64
"""Of each booking in the flood: 1.28M blocks in all, which the router held (over 90 MB) before the peers' caps."""
RSS_GROWTH_MAX = 24 * 2**20
"""The 200 bookings the peers' cap lets in hold about 2 MB; the rest is room for buffers and the allocator."""


async def test_a_flood_of_peers_bookings_stays_under_their_cap_and_the_routers_own_routes_get_200(
        server: NatsServer, names: PlaneNames, tmp_path: Path) -> None:
    """A real `kvctl serve`: its peers' caps derived from its own (--max-reservations 200), its RSS measured while
    the flood comes in, its own 200 reservations answered 200 after it, the 201st 429 (its own cap)."""
    with serving(tmp_path, "--nats", server.url, "--namespace", names.namespace, "--replica-sync",
                 "--max-reservations", "200", "--max-reserved-tokens", str(200 * BLOCKS * 16)) as (proc, client):
        assert client.post("/v1/workers", json={"worker_id": 1}).status_code == 201
        samples = [_rss(proc.pid)]  # the router's resident memory: before, during and after the flood
        async with connected(server) as nc:
            anyone = Anyone(nc, names)
            for n in range(FLOOD):
                await nc.publish(anyone.subject, anyone.writer.wrap(encode_sequence_event(
                    event(f"peer-{n}", AddRequest(list(range(n * BLOCKS, (n + 1) * BLOCKS)), True, None, None))), 0))
                if n % 1000 == 0:
                    await nc.flush()
                    samples.append(_rss(proc.pid))
            await nc.flush()

        def plane() -> dict:
            return client.get("/v1/status").json()["event_plane"]  # type: ignore[no-any-return]

        def taken_in() -> bool:
            samples.append(_rss(proc.pid))
            return plane()["counts"].get("peer_sequence_events", 0) >= FLOOD

        eventually(taken_in, "the flood taken in", timeout=60)
        growth = max(samples) - samples[0]
        assert growth < RSS_GROWTH_MAX, f"RSS grew {growth / 2**20:.0f} MB during the flood"
        peers = plane()["peers"]
        assert (peers["requests"], peers["max_peer_reservations"]) == (200, 200)
        losses = {(x["surface"], x["cause"]): x["count"] for x in client.get("/v1/status").json()["health"]["losses"]}
        assert losses[("replica_sync", "max_peer_reservations")] == FLOOD - 200

        routes = [client.post("/v1/route", json={"token_ids": list(range(n, n + 64)), "reserve": True,
                                                 "request_id": f"own-{n}"}) for n in range(201)]
        assert [r.status_code for r in routes[:200]] == [200] * 200, routes[0].text
        assert routes[200].status_code == 429 and json.loads(routes[200].text)["limit"] == "max_reservations"
        assert client.get("/readyz").status_code == 200
