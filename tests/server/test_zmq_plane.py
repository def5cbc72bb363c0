"""Dynamo's ZMQ event plane against real pyzmq sockets: captured frames in, the index and status out.

A "fleet" here is one XPUB socket (a PUB that also tells who subscribed, so the test publishes only once the
router's SUB is joined) per publisher of `zmq_capture.jsonl`, each sending exactly the frames captured from
Dynamo 1.6.1, and a discovery store holding their `EventChannel` records: a file-discovery dir, or a real etcd
(each test runs on both). The records are the captured store's (`file-discovery/`), rewritten to this test's
loopback ports (and, for the publishers whose record the store copy lacks, the same topic's record given their
instance id): the only bytes not Dynamo's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio

from kvctl.core.events import RouterEvent
from kvctl.core.events.discovery import ChannelKey, encode_file_name, namespace_prefix, parse_event_channel
from kvctl.core.events.dynamo import decode_envelope, decode_router_event_batch
from kvctl.core.events.plane import KV_EVENTS, TOPICS, AddRequest, decode_sequence_events
from kvctl.core.events.zmq_wire import decode_zmq_message
from kvctl.errors import DiscoveryError
from kvctl.server.ingest.streams import Streams
from kvctl.server.plane.dynamo_discovery import KEY_TTL_S, FileDiscovery, open_discovery
from kvctl.server.plane.etcd_discovery import EtcdDiscovery
from kvctl.server.plane.zmq_plane import ZmqOptions, ZmqPlane
from kvctl.server.state import Fleet
from tests.etcd_server import EtcdServer
from tests.fixtures_path import FIXTURES
from tests.nats_server import free_port
from tests.server.test_nats_plane import dump_blocks, expected_blocks
from tests.support import eventually_async

ZMQ = FIXTURES / "dynamo-1.6.1-fleet" / "zmq-plane"
STORE = ZMQ / "file-discovery" / "v1" / "event_channels"
POLL_S = 0.05


def captured() -> dict[tuple[str, int], list[list[bytes]]]:
    """Every captured message's frames, by (topic, publisher id), in capture order."""
    out: dict[tuple[str, int], list[list[bytes]]] = {}
    for line in (ZMQ / "zmq_capture.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.setdefault((row["discovery_topic"], row["discovery_instance_id"]), []).append(
            [bytes.fromhex(f) for f in row["frames_hex"]])
    return out


def record_for(topic: str, publisher_id: int, address: str) -> bytes:
    """The captured store's record of this publisher (any of its topic's when the copy lacks it), at `address`."""
    records = [json.loads(p.read_text()) for p in STORE.iterdir()]
    same = [r for r in records if r["instance_id"] == publisher_id] or [r for r in records if r["topic"] == topic]
    record = dict(same[0], instance_id=publisher_id)
    record["transport"] = {"kind": "Zmq", "config": {"endpoint": address}}
    return json.dumps(record, separators=(",", ":")).encode()


@dataclass
class Publisher:
    topic: str
    publisher_id: int
    socket: zmq.asyncio.Socket
    address: str
    withdraw: Callable[[], None]  # its record deleted, as a clean stop does

    async def joined(self) -> None:
        """Until the router's SUB has subscribed (XPUB hands over the subscription)."""
        assert await asyncio.wait_for(self.socket.recv(), 10) == b"\x01"


class Bench:
    """Publishers on loopback and their records in a file-discovery dir, and a router following them."""

    def __init__(self, root: Path, etcd: EtcdServer | None = None) -> None:
        self.root = root
        self.etcd = etcd
        self.bucket = root / "v1" / "event_channels"
        self.bucket.mkdir(parents=True)
        self.url = f"etcd:{etcd.url}" if etcd is not None else f"file:{root}"
        self.ctx = zmq.asyncio.Context()
        self.publishers: list[Publisher] = []
        self.fleet = Fleet(block_size=16, seed=0)
        self.streams = Streams(self.fleet)
        self.plane: ZmqPlane | None = None
        self._refresher: asyncio.Task[None] | None = None

    def publish_as(self, topic: str, publisher_id: int, component: str = "backend") -> Publisher:
        sock = self.ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        address = f"tcp://127.0.0.1:{port}"
        key = ChannelKey("dynamo", component, "generate", topic, publisher_id).key
        record = json.loads(record_for(topic, publisher_id, address))
        record["scope"]["endpoint"]["component"] = component
        publisher = Publisher(topic, publisher_id, sock, address, self.put(key, json.dumps(record).encode()))
        self.publishers.append(publisher)
        return publisher

    def put(self, key: str, value: bytes) -> Callable[[], None]:
        """A record in the store; what deletes it."""
        if self.etcd is not None:
            self.etcd.put(key, value)
            return partial(self.etcd.delete, key)
        path = self.bucket / encode_file_name(key.removeprefix("v1/event_channels/"))
        path.write_bytes(value)
        return path.unlink

    async def _refresh(self) -> None:
        """Touch the file records every second, as their Dynamo owners would (untouched for 10 s, they are dead)."""
        while True:
            for path in self.bucket.iterdir():
                with contextlib.suppress(FileNotFoundError):
                    os.utime(path)
            await asyncio.sleep(1)

    async def start(self, **options: Any) -> ZmqPlane:
        if self.etcd is None:
            self._refresher = asyncio.get_running_loop().create_task(self._refresh())
        self.plane = ZmqPlane(self.fleet, self.streams, ZmqOptions(discovery=self.url, router_id=1, **{"poll_s": POLL_S,
                                                                                             **options}))
        self.plane.start()
        assert await self.plane.ready(10), self.plane.status()
        return self.plane

    def status(self) -> dict[str, Any]:
        assert self.plane is not None
        return self.plane.status()

    def addresses(self) -> set[str]:
        return {c["address"] for c in self.status()["connections"]}

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        if self.plane is not None:
            await self.plane.close()
        await self.streams.close()
        self.ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    yield server
    server.stop()


@pytest.fixture(params=["file", "etcd"])
async def bench(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Bench]:
    etcd = request.getfixturevalue("etcd") if request.param == "etcd" else None
    b = Bench(tmp_path / "discovery", etcd)
    yield b
    await b.close()
    if etcd is not None:
        etcd.delete_prefix("v1/")  # the next test's store starts empty


def captured_kv_events(messages: dict[tuple[str, int], list[list[bytes]]]) -> list[RouterEvent]:
    events: list[RouterEvent] = []
    for (topic, _), frames in messages.items():
        if topic == KV_EVENTS:
            for message in frames:
                events += decode_router_event_batch(decode_envelope(decode_zmq_message(message).envelope).payload)[0]
    return events


async def test_every_captured_message_reaches_the_ingest_and_the_index(bench: Bench) -> None:
    messages = captured()
    publishers = {key: bench.publish_as(*key) for key in messages}
    plane = await bench.start(replica_sync=True, shadow=True)  # peers' requests taken, none shared
    assert bench.addresses() == {p.address for p in publishers.values()}
    for key, publisher in publishers.items():
        await publisher.joined()
        for frames in messages[key]:
            await publisher.socket.send_multipart(frames)
    topics = Counter(topic for topic, _ in messages for _ in messages[(topic, _)])
    await eventually_async(lambda: bench.status()["topics"] == {t: topics[t] for t in TOPICS}, "every message ingested")
    await bench.streams.writer("default").applied()

    status = bench.status()
    assert status["decode_errors"] == {} and status["sequence"]["lost"] == 0, status
    assert status["transport"] == "zmq" and status["ready"] and status["state"] == "connected"
    assert status["counts"]["load_reports"] == topics["kv_metrics"]
    assert status["counts"]["forward_passes"] == topics["forward-pass-metrics"]
    assert status["counts"]["peer_sequence_events"] > topics["active_sequences_events"]  # batches of several
    rows = {(c["topic"], c["publisher_id"]): c for c in status["connections"]}
    assert {(p["topic"], p["publisher_id"]): p["address"] for p in status["publishers"]} == \
        {k: r["address"] for k, r in rows.items() if k in {(p["topic"], p["publisher_id"]) for p in
                                                           status["publishers"]}}
    assert {k: r["messages"] for k, r in rows.items()} == {k: len(v) for k, v in messages.items()}
    assert all(r["connected"] and r["channel"].startswith("v1/event_channels/namespace/dynamo/") for r in rows.values())
    assert status["subjects_seen"] == {f"v1/event_channels/namespace/dynamo/component/backend/endpoint/generate/"
                                       f"topic/{t}": 2 for t in TOPICS}
    index, expected = plane.fleet.models["default"].router.index, expected_blocks(captured_kv_events(messages))
    # A message is counted as it arrives, and its events reach the writer after the handler's awaits (a large
    # batch is decoded off the loop), so the writer's `applied` above may come first on a loaded machine.
    await eventually_async(lambda: dump_blocks(index.dump()), "every KV event in the index",
                           until=lambda blocks: blocks == expected)


async def test_a_publisher_is_dropped_with_its_record_and_a_worker_with_its_last_one(bench: Bench) -> None:
    worker = (2077671668877197043, 0)  # the captured load report's and forward pass's worker
    load, passed = captured()[("kv_metrics", 1610214894536196)][0], captured()[("forward-pass-metrics",
                                                                              3421307315943300)][0]
    first, other = bench.publish_as("kv_metrics", 11), bench.publish_as("forward-pass-metrics", 13)
    await bench.start()
    for publisher, frames in ((first, load), (other, passed)):
        await publisher.joined()
        await publisher.socket.send_multipart(frames)
    await eventually_async(lambda: bench.status()["counts"].get("forward_passes") == 1, "both reports ingested")
    first.withdraw()  # a clean stop deletes its keys
    await eventually_async(lambda: bench.addresses() == {other.address}, "the gone publisher dropped")
    assert set(bench.fleet.workers) == {worker}  # still spoken for by its other publisher
    other.withdraw()
    await eventually_async(lambda: bench.addresses() == set(), "the last publisher dropped")
    assert bench.fleet.workers == {} and bench.status()["counts"]["workers_removed"] == 1

    second = bench.publish_as("kv_metrics", 12)  # a new identity
    await eventually_async(lambda: bench.addresses() == {second.address}, "the new publisher followed")
    await second.joined()
    await second.socket.send_multipart(captured()[("kv_metrics", 2000662664498406)][0])
    await eventually_async(lambda: bench.status()["counts"].get("load_reports") == 2, "its report ingested")
    assert [c["publisher_id"] for c in bench.status()["connections"]] == [12] and len(bench.fleet.workers) == 1


async def test_malformed_frames_and_records_are_counted_and_skipped(bench: Bench) -> None:
    publisher = bench.publish_as("kv_metrics", 21)
    (bench.bucket / "stray.swp").write_text("x")  # the file backend's stray: a name that is no key
    bench.put(ChannelKey("dynamo", "backend", "generate", "kv-events", 22).key, b"{not json")
    elsewhere = bench.publish_as("kv-events", 23, component="prefill")
    await bench.start(component="backend")
    assert bench.addresses() == {publisher.address}  # the other component is seen, not followed
    assert elsewhere.address not in bench.addresses()
    await publisher.joined()
    good = captured()[("kv_metrics", 1610214894536196)][0]
    for frames in ([b"kv_metrics"], [*good[:3], good[3][:-1]], [good[0], b"\0", *good[2:]], good):
        await publisher.socket.send_multipart(frames)
    await eventually_async(lambda: bench.status()["counts"].get("load_reports") == 1,
                           "the good message after the bad ones")
    status = bench.status()
    assert status["decode_errors"] == {"bad_batch": 3}, status
    assert status["connections"][0]["decode_errors"] == {"bad_batch": 3}
    assert status["discovery"]["record_errors"] == {"bad_json": 1}
    if bench.etcd is None:
        assert status["discovery"]["stray"]["bad_file_name"] >= 1
    assert "v1/event_channels/namespace/dynamo/component/prefill/endpoint/generate/topic/kv-events" \
        in status["subjects_seen"]
    assert status["subjects"]["kv_events"] == \
        "v1/event_channels/namespace/dynamo/component/backend/endpoint/*/topic/kv-events"


async def test_ready_with_an_empty_store_then_follows_what_registers(bench: Bench) -> None:
    await bench.start()
    assert bench.status()["connections"] == [] and bench.status()["ready"]
    publisher = bench.publish_as("forward-pass-metrics", 31)
    await eventually_async(lambda: bench.addresses() == {publisher.address}, "a publisher registered later")
    await eventually_async(lambda: bench.status()["connections"][0]["connected"], "its socket connected")


def test_the_records_written_here_are_dynamos_but_for_the_address() -> None:
    original = next(p for p in STORE.iterdir() if "kv%2Devents" in p.name)
    channel = parse_event_channel(original.read_bytes())
    rewritten = parse_event_channel(record_for("kv-events", channel.publisher_id, "tcp://127.0.0.1:1"))
    assert rewritten.key == channel.key and rewritten.address == "tcp://127.0.0.1:1"


async def test_etcd_lists_the_namespace_only_and_falls_over_to_the_next_url(etcd: EtcdServer) -> None:
    ours = ChannelKey("dynamo", "backend", "generate", "kv-events", 0xABC).key
    etcd.put(ours, b"{}")
    etcd.put(ours.replace("/dynamo/", "/dynamo2/"), b"{}")  # a namespace whose name extends ours
    etcd.put("v1/instances/dynamo/backend/generate/abc", b"{}")
    dead = f"http://127.0.0.1:{free_port()}"
    store = EtcdDiscovery([dead, etcd.url])
    try:
        assert await store.list(namespace_prefix("dynamo")) == {ours: b"{}"}
        assert await store.list(namespace_prefix("dynamo")) == {ours: b"{}"}  # the live one is asked first now
        with pytest.raises(DiscoveryError, match="127.0.0.1"):
            await EtcdDiscovery([dead]).list(namespace_prefix("dynamo"))
    finally:
        await store.close()
        etcd.delete_prefix("v1/")


async def test_a_store_not_there_yet_is_retried_until_it_is(tmp_path: Path) -> None:
    root = tmp_path / "not-yet"
    fleet = Fleet(block_size=16, seed=0)
    streams = Streams(fleet)
    plane = ZmqPlane(fleet, streams, ZmqOptions(discovery=f"file:{root}", poll_s=POLL_S))
    plane.start()
    try:
        assert not await plane.ready(0.3) and "not a directory" in (plane.status()["last_error"] or "")
        root.mkdir()  # Dynamo's first process makes it
        assert await plane.ready(5) and plane.status()["connections"] == []
    finally:
        await plane.close()
        await streams.close()


async def test_a_record_rewritten_in_place_moves_the_socket(bench: Bench) -> None:
    publisher = bench.publish_as("kv_metrics", 41)
    await bench.start()
    await publisher.joined()
    await publisher.socket.send_multipart(captured()[("kv_metrics", 1610214894536196)][0])
    await eventually_async(lambda: len(bench.fleet.workers) == 1, "the worker known from its report")
    moved = bench.ctx.socket(zmq.XPUB)
    moved.setsockopt(zmq.LINGER, 0)
    address = f"tcp://127.0.0.1:{moved.bind_to_random_port('tcp://127.0.0.1')}"
    key = ChannelKey("dynamo", "backend", "generate", "kv_metrics", 41).key
    try:
        bench.put(key, record_for("kv_metrics", 41, address))  # the same key, another size: re-read
        await eventually_async(lambda: bench.addresses() == {address}, "the socket moved to the record's new address")
        assert await asyncio.wait_for(moved.recv(), 10) == b"\x01"  # and subscribed there
        assert len(bench.fleet.workers) == 1  # a publisher that moved is not a worker that left
    finally:
        moved.close()


async def listed(url: str) -> dict[str, bytes]:
    """The namespace's records, as another reader of the store sees them."""
    store = open_discovery(url)
    try:
        return await store.list(namespace_prefix("dynamo"))
    finally:
        await store.close()


async def test_replica_sync_files_a_channel_per_scope_and_shares_this_routers_requests(bench: Bench) -> None:
    """As a Dynamo router does: a PUB socket and an `active_sequences_events` record under the workers' scope,
    each add / free sent there as a one-event batch; followed by this router too (its own, ignored by id);
    the record gone when the router stops."""
    publisher = bench.publish_as("kv_metrics", 41)
    plane = await bench.start(replica_sync=True, advertise_host="127.0.0.1")
    await publisher.joined()
    await publisher.socket.send_multipart(captured()[("kv_metrics", 1610214894536196)][0])  # worker 2077...:0
    await eventually_async(lambda: len(bench.status()["sharing"]["channels"]) == 1, "this router's channel filed")
    await eventually_async(lambda: bench.status()["counts"].get("load_reports") == 1, "the worker heard of")
    (shared,) = bench.status()["sharing"]["channels"]
    records = await plane.discovery.list(namespace_prefix("dynamo"))
    channel = parse_event_channel(records[shared["channel"]])
    assert (channel.component, channel.endpoint, channel.topic) == ("backend", "generate", "active_sequences_events")
    assert channel.address == shared["address"] and channel.address.startswith("tcp://127.0.0.1:")
    assert channel.publisher_id == shared["publisher_id"]

    sub = bench.ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(channel.address)
    try:  # a SUB joins asynchronously: book requests until one arrives
        got: list[bytes] = []
        for n in range(200):
            bench.fleet.route("default", now=asyncio.get_running_loop().time(), token_ids=list(range(64)),
                              request_id=f"r{n}", reserve=True)
            with contextlib.suppress(TimeoutError):
                got = await asyncio.wait_for(sub.recv_multipart(), 0.05)
                break
        assert got, "no request of this router's reached a subscriber of its channel"
        first = decode_zmq_message(got)
        assert bench.fleet.free("default", f"r{n}")
        freed = decode_zmq_message(await asyncio.wait_for(sub.recv_multipart(), 5))
    finally:
        sub.close(linger=0)
    assert first.topic == freed.topic == "active_sequences_events"
    assert first.publisher_id == freed.publisher_id == channel.publisher_id and freed.sequence == first.sequence + 1
    (add,), errors = decode_sequence_events(decode_envelope(first.envelope).payload)
    (free,), _ = decode_sequence_events(decode_envelope(freed.envelope).payload)
    assert errors == [] and (add.request_id, add.worker_id, add.router_id) == (f"r{n}", 2077671668877197043, 1)
    assert isinstance(add.action, AddRequest) and (free.request_id, free.action) == (f"r{n}", "Free")
    for n in range(200):  # its own channel followed too (its SUB joins asynchronously), its events its own
        bench.fleet.route("default", now=asyncio.get_running_loop().time(), token_ids=list(range(64)),
                          request_id=f"own{n}", reserve=True)
        if bench.status()["counts"].get("own_sequence_events", 0) > 0:
            break
        await asyncio.sleep(0.05)
    assert bench.status()["counts"].get("own_sequence_events", 0) > 0 and "peer_sequence_events" not in \
        bench.status()["counts"]

    await plane.close()
    bench.plane = None
    remaining = await listed(bench.url)
    assert shared["channel"] not in remaining and len(remaining) == 1  # the publisher's record stays


async def test_a_shadow_router_files_nothing(bench: Bench) -> None:
    publisher = bench.publish_as("kv_metrics", 51)
    await bench.start(replica_sync=True, shadow=True)
    await publisher.joined()
    await publisher.socket.send_multipart(captured()[("kv_metrics", 1610214894536196)][0])
    await eventually_async(lambda: bench.status()["counts"].get("load_reports") == 1, "the report ingested")
    assert bench.status()["sharing"] is None and bench.status()["shadow"] and bench.fleet.sequence_listener is None
    assert len(await listed(bench.url)) == 1


async def test_file_records_left_untouched_are_dead_and_own_records_are_kept_alive(tmp_path: Path) -> None:
    """Dynamo's file backend: owners touch their files; one untouched for 10 s is a dead process's. A
    half-written `.tmp_` file is neither a record nor a stray."""
    store = FileDiscovery(tmp_path)
    key = ChannelKey("dynamo", "backend", "generate", "active_sequences_events", 0xABC).key
    await store.register(key, b"{}")
    path = tmp_path / "v1" / "event_channels" / encode_file_name(key.removeprefix("v1/event_channels/"))
    (path.parent / ".tmp_0123456789abcdef").write_bytes(b"{")
    stale = time.time() - KEY_TTL_S - 1
    os.utime(path, (stale, stale))
    assert await store.list(namespace_prefix("dynamo")) == {} and store.expired == 1 and not store.refusals.counts
    await store.keep_alive()
    assert await store.list(namespace_prefix("dynamo")) == {key: b"{}"}
    path.unlink()  # deleted as expired by a Dynamo process while this one stalled: filed again
    await store.keep_alive()
    assert await store.list(namespace_prefix("dynamo")) == {key: b"{}"}
    await store.close()
    assert not path.exists()


async def test_etcd_records_live_under_a_lease_filed_again_if_it_runs_out(etcd: EtcdServer) -> None:
    store = EtcdDiscovery([etcd.url])
    key = ChannelKey("dynamo", "backend", "generate", "active_sequences_events", 0xDEF).key
    try:
        await store.register(key, b"{}")
        assert await listed(f"etcd:{etcd.url}") == {key: b"{}"}
        assert store._lease is not None
        httpx.post(f"{etcd.url}/v3/lease/revoke", json={"ID": store._lease}, timeout=5).raise_for_status()
        assert await listed(f"etcd:{etcd.url}") == {}  # the lease ran out: its keys went with it
        await store.keep_alive()
        assert await listed(f"etcd:{etcd.url}") == {key: b"{}"}
    finally:
        await store.close()
    assert await listed(f"etcd:{etcd.url}") == {}  # revoked on close


async def test_etcd_records_are_watched_not_polled(etcd: EtcdServer, tmp_path: Path) -> None:
    """With a poll a minute apart, a record filed or deleted is still followed at once: etcd's watch says so."""
    bench = Bench(tmp_path / "discovery", etcd)
    try:
        await bench.start(poll_s=60.0)
        assert bench.status()["discovery"]["follows"] == "watch"
        publisher = bench.publish_as("kv_metrics", 61)
        await eventually_async(lambda: bench.addresses() == {publisher.address},
                               "a record filed after the range", timeout=5)
        publisher.withdraw()
        await eventually_async(lambda: bench.addresses() == set(), "a record deleted", timeout=5)
        assert bench.status()["discovery"]["listings"] == 3  # the range, then one change each
    finally:
        await bench.close()
        etcd.delete_prefix("v1/")


@pytest.mark.parametrize("bench", ["file"], indirect=True)
async def test_a_frame_over_the_limit_is_counted_and_the_publisher_followed_again(bench: Bench) -> None:
    """libzmq drops the connection that sent it and never makes it again; the plane does, and counts it."""
    bench.streams.max_message_bytes = 64 * 1024
    publisher = bench.publish_as("kv_metrics", 51)
    await bench.start()
    await publisher.joined()
    await publisher.socket.send_multipart([b"kv_metrics", b"\0" * 8, b"\0" * 8, b"x" * (1 << 20)])
    while await asyncio.wait_for(publisher.socket.recv(), 10) != b"\x01":  # until subscribed again
        continue
    await publisher.socket.send_multipart(captured()[("kv_metrics", 1610214894536196)][0])
    await eventually_async(lambda: bench.status()["counts"].get("load_reports") == 1, "the report after it")
    (row,) = bench.status()["connections"]
    assert row["too_large"] == 1 and row["connected"] and row["decode_errors"] == {}
    assert bench.fleet.health.losses[("zmq", "too_large")].count == 1


@pytest.mark.parametrize("bench", ["file"], indirect=True)
async def test_a_flood_of_publisher_ids_is_bounded_and_counted(bench: Bench) -> None:
    """4,196 publisher ids on one socket: the book keeps the last 4,096 (a new id costs no scan of them), the 100
    forgotten are counted in the ledger, and the loop runs while the socket's backlog is taken in (a probe that
    runs whenever the loop does finds it part ingested, many times: not once the flood is over)."""
    from kvctl.core.events.dynamo import EnvelopeWriter
    from kvctl.core.events.publishers import MAX_PUBLISHERS
    from kvctl.core.events.zmq_wire import ZmqMessage, encode_zmq_message

    report = decode_envelope(decode_zmq_message(captured()[("kv_metrics", 1610214894536196)][0]).envelope).payload
    publisher = bench.publish_as("kv_metrics", 61)
    publisher.socket.setsockopt(zmq.SNDHWM, 0)  # the whole flood queued at once, none dropped
    plane = await bench.start()
    await publisher.joined()
    ids = range(1000, 1000 + MAX_PUBLISHERS + 100)
    counts, seen = plane.counts, set()

    async def probe() -> None:
        while True:
            seen.add(counts.get("load_reports", 0))
            await asyncio.sleep(0)

    probing = asyncio.get_running_loop().create_task(probe())
    for publisher_id in ids:
        envelope = EnvelopeWriter(publisher_id, "kv_metrics").wrap(report, 0)
        publisher.socket.send_multipart(encode_zmq_message(ZmqMessage("kv_metrics", publisher_id, 0, envelope)))
    await eventually_async(lambda: counts.get("load_reports") == len(ids), "every report")
    probing.cancel()
    assert len({n for n in seen if 0 < n < len(ids)}) >= 10, sorted(seen)
    assert bench.status()["sequence"]["publishers"] == MAX_PUBLISHERS
    assert bench.fleet.health.losses[("zmq", "too_many_publishers")].count == 100
    assert "publisher 1099 " in bench.fleet.health.losses[("zmq", "too_many_publishers")].detail
    assert len(next(iter(plane.links.values())).publisher_ids) == MAX_PUBLISHERS
