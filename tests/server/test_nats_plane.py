"""The event plane against a real nats-server with JetStream: Dynamo's encodings in, the index out.

Each test uses its own namespace, so streams, buckets and subjects never meet across tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator, Iterator

import nats
import pytest

from kvctl.core.events import Removed, RouterEvent, Stored
from kvctl.core.events.dynamo import (
    EventEnvelope,
    decode_kv_cache_event,
    encode_envelope,
    encode_router_event_batch,
    encode_router_event_json,
)
from kvctl.core.events.plane import (
    RADIX_STATE_OBJECT,
    ActiveLoad,
    ForwardPass,
    PlaneNames,
    RequestCounts,
    encode_active_load,
    encode_forward_pass,
)
from kvctl.core.hashing import local_block_hashes, sequence_hashes
from kvctl.core.index import KvIndex
from kvctl.nats.barrier import barrier
from kvctl.nats.connection import NatsConnection
from kvctl.server.ingest.streams import Streams
from kvctl.server.plane.nats_plane import EventPlane, NatsOptions
from kvctl.server.state import Fleet
from kvctl.server.worker_info import WorkerInfo
from tests.fixtures_path import FIXTURES
from tests.nats_server import NatsServer
from tests.support import eventually_async

_namespaces = itertools.count()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    srv = NatsServer(tmp_path_factory.mktemp("nats"))
    yield srv
    srv.stop()


@pytest.fixture
def names() -> PlaneNames:
    return PlaneNames(f"test{next(_namespaces)}", "backend")


class Router:
    """A Fleet with its writers and event plane, as `kvctl serve --nats` runs them, in this loop."""

    def __init__(self, options: NatsOptions, **streams: int) -> None:
        self.fleet = Fleet(block_size=16, seed=0)
        self.streams = Streams(self.fleet, **streams)
        self.plane = EventPlane(self.fleet, self.streams, options)

    async def __aenter__(self) -> Router:
        self.plane.start()
        assert await self.plane.ready(10), self.plane.status()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.plane.close()
        await self.streams.close()

    def blocks(self) -> dict[tuple[int, int], set[tuple[int | None, int]]]:
        """Per worker, every (parent, block) edge it holds: equal for equal trees, whatever the dump's shape."""
        return dump_blocks(self.fleet.models["default"].router.index.dump())


def dump_blocks(events: list[RouterEvent]) -> dict[tuple[int, int], set[tuple[int | None, int]]]:
    out: dict[tuple[int, int], set[tuple[int | None, int]]] = {}
    for ev in events:
        assert isinstance(ev.data, Stored)
        parent = ev.data.parent_hash
        for h in ev.data.block_hashes:
            out.setdefault((ev.worker_id, ev.dp_rank), set()).add((parent, h))
            parent = h
    return out


def options(server: NatsServer, names: PlaneNames, **kw: object) -> NatsOptions:
    return NatsOptions(connection=NatsConnection(server.url), namespace=names.namespace, component=names.component,
                       router_id=kw.pop("router_id", 1), **kw)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def connected(server: NatsServer) -> AsyncIterator[nats.NATS]:
    nc = await nats.connect(server.url)
    try:
        yield nc
    finally:
        await nc.drain()


def store(worker_id: int, event_id: int, tokens: list[int], parent: int | None = None) -> RouterEvent:
    local = local_block_hashes(tokens, 16)
    return RouterEvent(worker_id, Stored(parent, sequence_hashes(local), local), 0, event_id)


def envelope(ev: RouterEvent, sequence: int, publisher_id: int = 77) -> bytes:
    """One event as Dynamo 1.6.1 publishes it: a one-event array in the envelope."""
    return encode_envelope(EventEnvelope(publisher_id, sequence, 1_700_000_000_000, "kv-events",
                                         encode_router_event_batch([ev])))


def fixture_events() -> list[RouterEvent]:
    """Dynamo 1.6.1's own KV cache events (its RadixTree.apply_event inputs), ids as Dynamo numbered them."""
    lines = (FIXTURES / "dynamo-1.6.1" / "events_applied.jsonl").read_text().splitlines()
    return [decode_kv_cache_event(json.loads(line)["event_json"], json.loads(line)["worker_id"]) for line in lines]


def expected_blocks(events: list[RouterEvent]) -> dict[tuple[int, int], set[tuple[int | None, int]]]:
    index = KvIndex()
    index.load(events)
    return dump_blocks(index.dump())


# ----- NATS Core -----------------------------------------------------------------------------------------

async def test_core_events_in_dynamo_encoding_reach_the_index(server: NatsServer, names: PlaneNames) -> None:
    events = fixture_events()
    async with Router(options(server, names)) as router, connected(server) as nc:
        await nc.publish(names.kv_events, b"\x93not an envelope")  # garbage first: counted, never fatal
        await nc.publish(names.kv_events, encode_envelope(EventEnvelope(1, 1, 0, "kv-events", b"\xc1")))
        for n, ev in enumerate(events, 1):
            await nc.publish(names.kv_events, envelope(ev, n))
        await barrier(nc)
        await eventually_async(lambda: router.plane.counts["events"] == len(events), "every event")
        await router.streams.writer("default").applied()
        assert router.blocks() == expected_blocks(events)
        status = router.plane.status()
        assert sum(status["decode_errors"].values()) == 2
        assert status["counts"]["messages"] == len(events) + 2
        assert status["state"] == "connected" and status["mode"] == "core"


async def test_order_is_judged_per_publisher_and_no_event_id_freezes_a_worker(server: NatsServer,
                                                                              names: PlaneNames) -> None:
    tokens = list(range(64))
    first = store(5, 1, tokens[:32])
    sequence = [(0, first), (1, store(5, 2, tokens[32:48], first.data.block_hashes[-1])),  # type: ignore[union-attr]
                (4, store(5, 5, tokens[48:64])),  # envelopes 2 and 3 (events 3 and 4) never came
                (4, store(5, 5, list(range(300, 316)))),  # the same envelope again: dropped
                (0, store(5, 1, list(range(900, 916))))]  # sequence and ids start over: the publisher restarted
    absurd = [store(6, 1, list(range(1000, 1016))), store(6, 2**63, list(range(1100, 1116))),
              store(6, 3, list(range(1200, 1216)))]  # one absurd id, then the publisher's next event
    async with Router(options(server, names)) as router, connected(server) as nc:
        for n, ev in sequence:
            await nc.publish(names.kv_events, envelope(ev, n))
        for n, ev in enumerate(absurd):
            await nc.publish(names.kv_events, envelope(ev, n, publisher_id=78))
        await barrier(nc)
        await eventually_async(lambda: router.plane.counts["events"] == 7, "every event but the repeated envelope")
        await router.streams.writer("default").applied()
        counts, status = router.plane.counts, router.plane.status()
        # worker 6's id 2 never came (2^63 did instead): one more gap; the jump kept its place, so 3 follows 1
        assert (counts["gaps"], counts["lost_events"], counts["restarts"]) == (2, 3, 1)
        assert (counts["event_id_jumps"], counts.get("event_id_regressions")) == (1, None)
        assert status["sequence"] == {"publishers": 2, "gaps": 1, "lost": 2, "restarts": 1, "repeats": 1,
                                      "jumps": 0}
        # the restart cleared what worker 5 held before; worker 6 took every event, the absurd one included
        assert router.blocks() == expected_blocks([sequence[-1][1], *absurd])
        assert status["workers"] == [
            {"worker_id": 5, "dp_rank": 0, "publisher_id": 77, "last_event_id": 1},
            {"worker_id": 6, "dp_rank": 0, "publisher_id": 78, "last_event_id": 3}]
        assert [(p["publisher_id"], p["last_sequence"], p["workers"]) for p in status["publishers"]] == [
            (77, 0, ["5:0"]), (78, 2, ["6:0"])]


async def test_a_new_publisher_whose_ids_start_above_1_restarts_its_worker(server: NatsServer,
                                                                          names: PlaneNames) -> None:
    """A worker that came back under a new publisher id, its first event id 3 (below the old 5): once dropped
    as stale; now the old blocks are cleared and the new ones applied."""
    old = [store(5, n, list(range(100 * n, 100 * n + 16))) for n in range(1, 6)]
    new = [store(5, n, list(range(900 + 100 * n, 916 + 100 * n))) for n in (3, 4)]
    async with Router(options(server, names)) as router, connected(server) as nc:
        for n, ev in enumerate(old):
            await nc.publish(names.kv_events, envelope(ev, n, publisher_id=77))
        for n, ev in enumerate(new, 5):  # its sequence carries on: only the publisher id tells
            await nc.publish(names.kv_events, envelope(ev, n, publisher_id=79))
        await barrier(nc)
        await eventually_async(lambda: router.plane.counts["events"] == 7, "every event")
        await router.streams.writer("default").applied()
        assert router.plane.counts["restarts"] == 1
        assert router.blocks() == expected_blocks(new)


async def test_an_absurd_event_id_on_jetstream_freezes_no_worker(server: NatsServer, names: PlaneNames) -> None:
    """An event id of 2^63 once became the worker's place: every later event was dropped as stale, and acked
    away. Now it is a jump, counted and applied, and the events after it apply too; a redelivered copy of an
    applied one is still dropped."""
    events = [store(6, 1, list(range(1000, 1016))), store(6, 2**63, list(range(1100, 1116))),
              store(6, 2, list(range(1200, 1216))), store(6, 3, list(range(1300, 1316)))]
    async with Router(options(server, names, jetstream=True)) as router:
        await js_publish(server, names, [*events, events[2]])
        await eventually_async(lambda: router.plane.counts["messages"] == 5, "every message")
        await router.streams.writer("default").applied()
        counts = router.plane.counts
        assert (counts["events"], counts["event_id_jumps"], counts["stale_events"]) == (4, 1, 1)
        assert router.blocks() == expected_blocks(events)


def wrapped(topic: str, payload: bytes, sequence: int = 0, publisher_id: int = 90) -> bytes:
    return encode_envelope(EventEnvelope(publisher_id, sequence, 1_700_000_000_000, topic, payload))


async def test_load_reports_are_shown_and_feed_the_busy_check(server: NatsServer, names: PlaneNames) -> None:
    async with Router(options(server, names)) as router, connected(server) as nc:
        router.fleet.register(WorkerInfo(3, 0, "default", total_blocks=100))
        await nc.publish(names.kv_metrics, wrapped("kv_metrics", encode_active_load(ActiveLoad(3, 0, 4, 128, 95))))
        await nc.publish(names.kv_metrics, wrapped("kv_metrics", b"garbage", 1))
        await nc.publish(names.kv_metrics, b"not an envelope")
        await barrier(nc)
        await eventually_async(lambda: (3, 0) in router.fleet.reported, "the load report")
        row = router.fleet.worker_rows(time.monotonic())[0]
        assert row.reported is not None
        assert row.reported.kv_used_blocks == 95 and row.reported.active_prefill_tokens == 128
        router.fleet.thresholds.set("default", active_decode_blocks_threshold=0.9)
        assert router.fleet.rank_busy("default")[(3, 0)].busy  # 95 of 100 blocks used > 0.9
        await eventually_async(lambda: sum(router.plane.errors.values()) == 2, "both bad messages counted")


async def test_a_flood_of_publisher_ids_keeps_the_last_4096_and_counts_the_rest(server: NatsServer,
                                                                                  names: PlaneNames) -> None:
    """50,000 new publisher ids once stalled the loop 0.35-0.64 s each way: the book scanned its 4,096 for each."""
    from kvctl.core.events.publishers import MAX_PUBLISHERS

    report = encode_active_load(ActiveLoad(3, 0, 4, 128, 95))
    ids = range(MAX_PUBLISHERS + 50)
    async with Router(options(server, names)) as router, connected(server) as nc:
        for publisher_id in ids:
            await nc.publish(names.kv_metrics, wrapped("kv_metrics", report, publisher_id=publisher_id))
        await barrier(nc)
        await eventually_async(lambda: router.plane.counts["load_reports"] == len(ids), "every report")
        assert router.plane.status()["sequence"]["publishers"] == MAX_PUBLISHERS
        loss = router.fleet.health.losses[("nats", "too_many_publishers")]
        assert loss.count == 50 and "publisher 49 " in loss.detail


async def test_forward_passes_make_a_worker_known_and_are_shown(server: NatsServer, names: PlaneNames) -> None:
    report = ForwardPass(2**63 + 9, 1, 40, 0.002, RequestCounts(1, 67, 0.0, 0, 3, 900, 0.0),
                         RequestCounts(prefill_requests=2, prefill_tokens=130))
    async with Router(options(server, names)) as router, connected(server) as nc:
        await nc.publish(names.forward_pass, wrapped("forward-pass-metrics", encode_forward_pass(report)))
        await barrier(nc)
        await eventually_async(lambda: router.plane.counts["forward_passes"] == 1, "the forward pass")
        [row] = router.fleet.worker_rows(time.monotonic())
        assert (row.worker_id, row.dp_rank) == (2**63 + 9, 1)  # a routing candidate before any KV event
        assert router.fleet.candidates("default") == [(2**63 + 9, 1)]
        shown = row.forward_pass
        assert shown is not None
        assert (shown.scheduled_prefill_requests, shown.scheduled_decode_requests,
                shown.queued_prefill_requests, shown.queued_prefill_tokens) == (1, 3, 2, 130)


async def test_only_the_named_component_and_endpoint_are_followed(server: NatsServer, names: PlaneNames) -> None:
    ev = store(4, 1, list(range(16)))
    other = PlaneNames(names.namespace, "prefill", "generate")
    async with Router(options(server, names, endpoint="generate")) as router, connected(server) as nc:
        await nc.publish(other.kv_events, envelope(ev, 0))  # another component: counted by subject, not applied
        await nc.publish(PlaneNames(names.namespace, names.component, "clear").kv_events, envelope(ev, 0, 5))
        await nc.publish(f"namespace.{names.namespace}.component.{names.component}.kv-events", envelope(ev, 0, 6))
        await nc.publish(names.kv_events, envelope(ev, 0, 7))
        await barrier(nc)
        await eventually_async(lambda: router.plane.counts["events"] == 1, "the event in scope")
        status = router.plane.status()
        assert status["topics"]["kv-events"] == 1
        assert set(status["subjects_seen"]) == {other.kv_events, names.kv_events,
                                                PlaneNames(names.namespace, names.component, "clear").kv_events,
                                                f"namespace.{names.namespace}.component.{names.component}.kv-events"}
        assert status["subjects"]["kv_events"] == f"namespace.{names.namespace}.component.backend.endpoint.generate" \
            ".kv-events"


# ----- JetStream -----------------------------------------------------------------------------------------

def workload(n: int) -> list[RouterEvent]:
    """Stores of fresh prompts on two workers, with every third one later removed again."""
    out: list[RouterEvent] = []
    ids = {1: 0, 2: 0}
    for k in range(n):
        w = 1 + k % 2
        ids[w] += 1
        ev = store(w, ids[w], list(range(1000 * k, 1000 * k + 32)))
        out.append(ev)
        if k % 3 == 2:
            ids[w] += 1
            out.append(RouterEvent(w, Removed(ev.data.block_hashes[1:]), 0, ids[w]))  # type: ignore[union-attr]
    return out


async def js_publish(server: NatsServer, names: PlaneNames, events: list[RouterEvent]) -> None:
    async with connected(server) as nc:
        js = nc.jetstream()
        for ev in events:
            await js.publish(names.stream_subject, encode_router_event_json(ev))


async def test_jetstream_events_are_applied_then_acked(server: NatsServer, names: PlaneNames) -> None:
    events = workload(20)
    async with Router(options(server, names, jetstream=True)) as router:
        await js_publish(server, names, events)
        async with connected(server) as nc:
            await nc.publish(f"{names.stream}.kv-events", b"{not json")  # garbage on the stream subject
            await barrier(nc)
        await eventually_async(lambda: router.plane.counts["messages"] == len(events) + 1, "every message")
        async with connected(server) as nc:
            js = nc.jetstream()
            info = await eventually_async(lambda: js.consumer_info(names.stream, "1"), "every message acked",
                                          until=lambda i: i.ack_floor.stream_seq >= len(events) + 1, timeout=5,
                                          interval=0.05)
            assert info.ack_floor.stream_seq == len(events) + 1
        assert router.blocks() == expected_blocks(events)
        assert router.plane.errors == {"bad_json": 1}


async def test_snapshot_purges_and_a_new_replica_boots_from_snapshot_and_tail(
        server: NatsServer, names: PlaneNames) -> None:
    events = workload(30)
    head, tail = events[:30], events[30:]
    async with Router(options(server, names, jetstream=True, snapshot_threshold=10)) as router:
        await js_publish(server, names, head)
        await eventually_async(lambda: router.plane.snapshot["uploads"] >= 1, "a snapshot upload", timeout=15)
        await js_publish(server, names, tail)
        await eventually_async(lambda: router.plane.counts["events"] >= len(events), "every event")
        await router.streams.writer("default").applied()
        async with connected(server) as nc:
            info = await nc.jetstream().stream_info(names.stream)
            assert info.state.first_seq > 1  # purged below the ack floor
        async with Router(options(server, names, jetstream=True, router_id=2, snapshot_threshold=10**9)) as fresh:
            assert fresh.plane.snapshot["loaded_events"]
            await eventually_async(lambda: fresh.blocks() == router.blocks(), "the new replica to catch up")
        assert router.blocks() == expected_blocks(events)


async def test_a_damaged_snapshot_costs_its_bad_lines_not_the_plane(server: NatsServer, names: PlaneNames) -> None:
    events = [store(w, 1, list(range(100 * w, 100 * w + 32))) for w in (1, 2, 3, 4)]
    good = [encode_router_event_json(ev) for ev in events]
    damaged = b"\n".join([good[0], b"{torn", *good[1:], b"\xff\xfe"])
    async with connected(server) as nc:
        js = nc.jetstream()
        await js.add_stream(name=names.stream, subjects=[f"{names.stream}.*"])
        bucket = await js.create_object_store(names.bucket)
        await bucket.put(RADIX_STATE_OBJECT, damaged)
    tail = [store(w, 1, list(range(5000 * w, 5000 * w + 48))) for w in (1, 5)]
    async with Router(options(server, names, jetstream=True)) as router:
        assert router.plane.state != "failed", router.plane.status()
        assert router.plane.snapshot["loaded_events"] == len(events) and router.plane.snapshot["bad_lines"] == 2
        await js_publish(server, names, tail)  # and the stream is still followed
        await eventually_async(lambda: router.plane.counts["events"] >= len(tail), "the stream's events")
        await router.streams.writer("default").applied()
        assert router.blocks() == expected_blocks(events + tail)
        assert sum(router.plane.errors.values()) == 2


async def test_reset_states_leaves_an_empty_stream_and_no_bucket(server: NatsServer, names: PlaneNames) -> None:
    async with Router(options(server, names, jetstream=True, snapshot_threshold=5)) as router:
        await js_publish(server, names, workload(12))
        await eventually_async(lambda: router.plane.snapshot["uploads"] >= 1, "a snapshot upload", timeout=15)
    async with Router(options(server, names, jetstream=True, reset_states=True, router_id=3)) as reset:
        assert reset.blocks() == {}
        async with connected(server) as nc:
            js = nc.jetstream()
            assert (await js.stream_info(names.stream)).state.messages == 0
            with pytest.raises(nats.js.errors.NotFoundError):
                await js.object_store(names.bucket)


# ----- replica sync --------------------------------------------------------------------------------------

async def test_replicas_share_in_flight_requests_and_ignore_their_own(server: NatsServer, names: PlaneNames) -> None:
    a_opts = options(server, names, replica_sync=True, router_id=11)
    b_opts = options(server, names, replica_sync=True, router_id=12)
    async with Router(a_opts) as a, Router(b_opts) as b:
        for fleet in (a.fleet, b.fleet):
            for wid in (1, 2):
                fleet.register(WorkerInfo(wid, 0, "default"))
        tokens = list(range(64))
        decision = a.fleet.route("default", now=time.monotonic(), token_ids=tokens, request_id="r1", reserve=True)
        await eventually_async(lambda: b.fleet.models["default"].router.sequences.get("r1", owner=11) is not None,
                               "the add on B, as A's booking")
        on_b = b.fleet.models["default"].router.sequences.load(decision.worker)
        assert on_b.active_blocks == 4 and on_b.active_prefill_tokens == 64
        assert a.fleet.prefill_complete("default", "r1")
        await eventually_async(
            lambda: b.fleet.models["default"].router.sequences.load(decision.worker).active_prefill_tokens == 0,
            "prefill complete on B")
        assert a.fleet.free("default", "r1")
        await eventually_async(lambda: b.fleet.models["default"].router.sequences.get("r1", owner=11) is None,
                               "the free on B")
        await eventually_async(lambda: a.plane.counts["own_sequence_events"] == 3, "A's own echoes")
        assert a.plane.counts["peer_sequence_events"] == 0 and b.plane.counts["peer_sequence_events"] == 3
        assert len(a.fleet.models["default"].router.sequences) == 0  # its echoes did not re-add r1


async def test_a_shadow_publishes_nothing(server: NatsServer, names: PlaneNames) -> None:
    async with Router(options(server, names, replica_sync=True, shadow=True, router_id=21)) as shadow, \
            connected(server) as nc:
        seen: list[bytes] = []

        async def on(msg: nats.aio.msg.Msg) -> None:
            seen.append(msg.data)

        await nc.subscribe(names.active_sequences, cb=on)
        await barrier(nc)
        shadow.fleet.register(WorkerInfo(1, 0, "default"))
        shadow.fleet.route("default", now=time.monotonic(), token_ids=list(range(32)), request_id="s", reserve=True)
        shadow.fleet.free("default", "s")
        assert shadow.plane.nc is not None
        await barrier(shadow.plane.nc)  # whatever the shadow queued has reached the server ...
        await barrier(nc)  # ... and whatever the server routed to us has arrived
        await asyncio.sleep(0.1)
        assert seen == []


def test_stream_and_bucket_names_are_dynamos() -> None:
    names = PlaneNames("dynamo", "backend")
    assert names.stream == "namespace-dynamo-component-backend-kv-events"
    assert names.bucket == "namespace-dynamo-component-backend-radix-bucket"
    assert names.stream_subject == "namespace-dynamo-component-backend-kv-events.kv-events"
    assert PlaneNames("My.NS", "prefill_w").stream == "namespace-my-ns-component-prefill-w-kv-events"


async def test_a_burst_larger_than_the_writer_queue_is_not_dropped(server: NatsServer, names: PlaneNames) -> None:
    """NATS Core has no backpressure: a full writer queue must make the subscription wait, never drop."""
    events = workload(300)
    async with Router(options(server, names), queue_batches=4) as router, connected(server) as nc:  # tiny
        writer = router.streams.writer("default")
        for n, ev in enumerate(events, 1):
            await nc.publish(names.kv_events, envelope(ev, n))
        await barrier(nc)
        await eventually_async(lambda: router.plane.counts["events"] == len(events), "every event", timeout=20)
        await writer.applied()
        assert writer.dropped_events == 0
        assert router.blocks() == expected_blocks(events)
