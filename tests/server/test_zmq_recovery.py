"""The ZMQ plane's recovery of a worker's index over Dynamo's request plane, against real sockets: a worker's
request-plane endpoint is a loopback TCP server that answers kvctl's request frame with the bytes a Dynamo 1.6.1
mocker answered a Dynamo router with (tests/fixtures/dynamo-1.6.1-fleet/request-plane/recovery_capture.jsonl),
connecting back to the address kvctl's request names. Only the answer's subject (a UUID, same length) is
kvctl's, so that it names kvctl's request; the worker's `EventSource` record is Dynamo's, at this test's port."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvctl.core.events import Removed, RouterEvent, Stored
from kvctl.core.events.discovery import encode_file_name
from kvctl.core.events.publishers import Order
from kvctl.core.events.request_plane import (
    Recovered,
    RequestFrame,
    ResponseStream,
    TwoPartReader,
    decode_recovery_response,
    decode_request_frame,
    handshake_subject,
    parse_event_source,
)
from kvctl.server.health import Health
from kvctl.server.plane.recovery import RecoveryClient
from kvctl.server.plane.recovery_answers import AnswerListener
from tests.core.test_request_plane_capture import exchanges
from tests.server.test_nats_plane import dump_blocks, expected_blocks
from tests.server.test_zmq_plane import Bench
from tests.support import eventually_async

CAPTURE = exchanges("recovery_capture.jsonl")[0]


TOO_NEW = exchanges("ranged_capture.jsonl")[1]  # the same worker's answer to a range past its newest event


async def read_request(reader: asyncio.StreamReader) -> RequestFrame:
    """One request frame off a worker's request-plane connection."""
    head = await reader.readexactly(2)
    path = await reader.readexactly(int.from_bytes(head))
    headers_len = await reader.readexactly(2)
    headers = await reader.readexactly(int.from_bytes(headers_len))
    payload_len = await reader.readexactly(4)
    payload = await reader.readexactly(int.from_bytes(payload_len))
    return decode_request_frame(head + path + headers_len + headers + payload_len + payload)


class Worker:
    """A worker's request-plane endpoint answering a tree-dump request with the captured dump, a ranged one
    with the captured TooNew."""

    def __init__(self, dump: dict[str, Any] = CAPTURE) -> None:
        self.dump = dump
        self.requests: list[dict[str, Any]] = []
        self.release = asyncio.Event()  # answer only once set (a test holds live events meanwhile)
        self.release.set()
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await read_request(reader)
        self.requests.append(request.query)
        capture = self.dump if request.query["start_event_id"] is None else TOO_NEW
        writer.write(bytes.fromhex(capture["ack"]))
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        await self.release.wait()
        stream = bytes.fromhex(capture["response_stream"])
        theirs = handshake_subject(TwoPartReader().feed(stream)[0][0])
        host, port = request.reply["address"].rsplit(":", 1)
        _, back = await asyncio.open_connection(host, int(port))
        back.write(stream.replace(theirs.encode(), request.reply["subject"].encode()))
        await back.drain()
        back.close()
        await back.wait_closed()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


def source_record(port: int, capture: dict[str, Any] = CAPTURE) -> bytes:
    record = json.loads(json.dumps(capture["event_source"]))
    target = record["metadata"]["recovery_target"]
    _, path = target["transport"]["tcp"].split("/", 1)
    target["transport"]["tcp"] = f"127.0.0.1:{port}/{path}"
    return json.dumps(record).encode()


def put_source(root: Path, port: int, capture: dict[str, Any] = CAPTURE) -> None:
    """The worker's event-source record, its recovery target at 127.0.0.1:`port`, in the file store at `root`."""
    key = "namespace/dynamo/component/backend/endpoint/generate/topic/kv-events/" \
          f"{capture['event_source']['publisher_id']:x}"
    directory = root / "v1" / "event_sources"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / encode_file_name(key)).write_bytes(source_record(port, capture))


def dumped(capture: dict[str, Any] = CAPTURE) -> Recovered:
    messages = TwoPartReader().feed(bytes.fromhex(capture["response_stream"]))
    stream = ResponseStream()
    for control, data in messages[1:]:
        stream.take(control, data)
    return decode_recovery_response(stream)


WORKER = (CAPTURE["event_source"]["metadata"]["worker"]["worker_id"], 0)


@pytest.fixture
async def bench(tmp_path: Any) -> AsyncIterator[Bench]:
    b = Bench(tmp_path / "discovery")
    yield b
    await b.close()


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    w = Worker()
    yield w
    await w.close()


def row(bench: Bench) -> dict[str, Any]:
    rows = {(w["worker_id"], w["dp_rank"]): w for w in bench.status()["workers"]}
    return rows.get(WORKER, {}).get("recovery") or {}


async def test_a_worker_found_in_discovery_is_recovered_from_its_tree_dump(bench: Bench, worker: Worker) -> None:
    put_source(bench.root, await worker.start())
    plane = await bench.start()
    await eventually_async(lambda: row(bench).get("state") == "recovered", "the worker recovered")
    await bench.streams.writer("default").applied()
    assert worker.requests == [{"worker_id": WORKER[0], "dp_rank": 0, "start_event_id": None, "end_event_id": None,
                                "supports_tree_dump_failed": True, "kind": "recovery"}]
    index = plane.fleet.models["default"].router.index
    assert dump_blocks(index.dump()) == expected_blocks(dumped().events)
    assert row(bench) | {"target": None} == {"state": "recovered", "reason": None, "target": None, "queries": 1,
                                             "events": 4, "last_event_id": 4,
                                             "publisher_id": CAPTURE["event_source"]["publisher_id"]}
    counts = bench.status()["counts"]
    assert {k: v for k, v in counts.items() if "recover" in k} == {"recovery_queries": 1, "recovered_workers": 1,
                                                                   "recovered_events": 4, "recovery_decode_errors": 0}


async def test_a_worker_whose_request_plane_is_nats_is_marked_partial_at_once(bench: Bench) -> None:
    """(Its record's transport rewritten to `{"nats": ...}`, as `--request-plane nats` files it.)"""
    record = json.loads(source_record(1))
    record["metadata"]["recovery_target"]["transport"] = {"nats": "namespace.dynamo.component.backend"}
    directory = bench.root / "v1" / "event_sources"
    directory.mkdir(parents=True)
    key = f"namespace/dynamo/component/backend/endpoint/generate/topic/kv-events/{record['publisher_id']:x}"
    (directory / encode_file_name(key)).write_text(json.dumps(record))
    await bench.start()
    await eventually_async(lambda: row(bench).get("state") == "partial", "the worker marked partial")
    assert "nats request plane" in row(bench)["reason"] and bench.status()["recovery"]["record_errors"] == {}


async def test_a_large_dump_arriving_in_one_read_is_taken_whole(bench: Bench) -> None:
    """A dump of 84 events (a 30 KB message) sent at once with its handshake: the handshake's size limit is
    not applied to the messages behind it."""
    large = exchanges("large_dump_capture.jsonl")[0]
    worker = Worker(large)
    try:
        put_source(bench.root, await worker.start(), large)
        plane = await bench.start()
        worker_id = large["event_source"]["metadata"]["worker"]["worker_id"]
        await eventually_async(lambda: bench.status()["counts"].get("recovered_workers") == 1, "the worker recovered")
        await bench.streams.writer("default").applied()
        assert len(dumped(large).events) == 84
        index = plane.fleet.models["default"].router.index
        assert dump_blocks(index.dump()) == expected_blocks(dumped(large).events) != {}
        assert bench.status()["recovery"]["stray_streams"] == 0 and worker_id in {w for w, _ in plane.ingest.cursors}
    finally:
        await worker.close()


async def test_an_unreachable_worker_is_followed_live_and_marked_partial_with_why(bench: Bench,
                                                                                    worker: Worker) -> None:
    port = await worker.start()
    await worker.close()  # nothing listens there any more
    put_source(bench.root, port)
    await bench.start()
    await eventually_async(lambda: row(bench).get("state") == "partial", "the worker marked partial")
    assert f"127.0.0.1:{port}" in row(bench)["reason"] and "failed" in row(bench)["reason"]
    assert bench.status()["counts"]["recovery_failures"] == 1


async def test_live_events_held_while_recovering_apply_after_the_dump_once(bench: Bench, worker: Worker) -> None:
    """Held: a copy of an event the dump holds (id 3, dropped) and one newer (id 5, applied after the dump)."""
    worker.release.clear()
    put_source(bench.root, await worker.start())
    plane = await bench.start()
    await eventually_async(lambda: bool(worker.requests), "the worker asked")
    ingest, dump = plane.ingest, dumped().events
    first = dump[0].data
    assert isinstance(first, Stored)
    stale = RouterEvent(WORKER[0], Stored(None, [999], [999]), 0, 3)  # would add block 999 if applied
    newer = RouterEvent(WORKER[0], Removed([first.block_hashes[-1]]), 0, 5)
    publisher = CAPTURE["event_source"]["publisher_id"]
    assert ingest.recovery is not None
    assert all(ingest.recovery.hold(e, Order.next, publisher, None) for e in (stale, newer))
    worker.release.set()
    await eventually_async(lambda: row(bench).get("state") == "recovered", "the worker recovered")
    await bench.streams.writer("default").applied()
    index = plane.fleet.models["default"].router.index
    assert dump_blocks(index.dump()) == expected_blocks([*dump, newer])
    assert ingest.counts["recovered_duplicates"] == 1 and ingest.cursors[WORKER].ids.last == 5


async def test_events_held_for_a_worker_whose_record_moves_are_kept_for_its_new_target(bench: Bench,
                                                                                        worker: Worker) -> None:
    """The first target never answers; the record moves to another (a re-registered endpoint): the events held
    meanwhile are applied after the new target's dump."""
    worker.release.clear()
    put_source(bench.root, await worker.start())
    plane = await bench.start()
    await eventually_async(lambda: bool(worker.requests), "the first target asked")
    first = dumped().events[0].data
    assert isinstance(first, Stored) and plane.ingest.recovery is not None
    newer = RouterEvent(WORKER[0], Removed([first.block_hashes[-1]]), 0, 5)
    assert plane.ingest.recovery.hold(newer, Order.next, CAPTURE["event_source"]["publisher_id"], None)
    moved = Worker()
    try:
        put_source(bench.root, await moved.start())
        await eventually_async(lambda: row(bench).get("state") == "recovered",
                               "the worker recovered from its new target")
        await bench.streams.writer("default").applied()
        index = plane.fleet.models["default"].router.index
        assert dump_blocks(index.dump()) == expected_blocks([*dumped().events, newer])
    finally:
        worker.release.set()
        await moved.close()


async def test_a_gap_in_live_event_ids_asks_the_worker_from_the_first_missing(bench: Bench, worker: Worker) -> None:
    """The worker (its captured answer) has nothing past its event 4: the gap stays, the worker is partial."""
    put_source(bench.root, await worker.start())
    plane = await bench.start()
    await eventually_async(lambda: row(bench).get("state") == "recovered", "the worker recovered")
    ingest = plane.ingest
    assert ingest.recovery is not None and ingest.cursors[WORKER].ids.last == 4
    first = dumped().events[0].data
    assert isinstance(first, Stored)
    after_gap = RouterEvent(WORKER[0], Removed([first.block_hashes[-1]]), 0, 6)
    assert ingest.recovery.hold(after_gap, Order.next, CAPTURE["event_source"]["publisher_id"], 4)
    await eventually_async(lambda: row(bench).get("state") == "partial", "the gap's query answered")
    assert worker.requests[-1]["start_event_id"] == 5 and "TooNew" in row(bench)["reason"]
    await bench.streams.writer("default").applied()
    counts = bench.status()["counts"]
    assert counts["recovery_gaps"] == 1 and counts["lost_events"] == 1 and ingest.cursors[WORKER].ids.last == 6
    index = plane.fleet.models["default"].router.index
    assert dump_blocks(index.dump()) == expected_blocks([*dumped().events, after_gap])


async def test_a_query_nobody_answers_times_out() -> None:
    accepted: list[asyncio.StreamWriter] = []
    silent = await asyncio.start_server(lambda _, w: accepted.append(w), "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    client = RecoveryClient(AnswerListener(Health()), timeout_s=0.3)
    await client.start()
    target = parse_event_source(source_record(port))
    assert target is not None
    with pytest.raises(TimeoutError):
        await client.query(target)
    await client.close()
    for writer in accepted:
        writer.close()
    silent.close()
    await silent.wait_closed()


async def test_a_stranger_on_the_answer_listener_is_counted_and_cut_off_early() -> None:
    """A connection that announces a huge first message, or names no query of ours, is dropped without
    buffering it, and counted; the listener goes on taking answers."""
    health = Health()
    client = AnswerListener(health)
    await client.start()
    for first in [(100 << 20).to_bytes(8, "big") + bytes(16),  # a 100 MiB handshake announced
                  bytes.fromhex(CAPTURE["response_stream"])]:  # a real answer, to a query nobody made
        reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
        writer.write(first)
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by kvctl
        writer.close()
        await writer.wait_closed()
    assert client.stray == 2 and health.losses[("recovery", "stray_connection")].count == 2
    await client.close()
