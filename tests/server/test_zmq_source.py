"""EngineStream against a real engine-side PUB and ROUTER on loopback, fed the real captured payloads.

The test plays the engine's publisher the way vLLM's `ZmqEventPublisher` does: every batch goes to
a replay buffer and out on PUB as `[topic, seq u64 BE, payload]`; the ROUTER answers `[b"", start]`
with every buffered batch with seq >= start, as `[b"", topic, seq, payload]` (vLLM >= 0.26, SGLang)
or `[b"", seq, payload]` (older vLLM), then the end marker. To force a gap a batch is buffered
but not sent live. Nothing on the ZMQ path is mocked.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvctl.core.events import Cleared, ErrorKind, EventData, Removed, Stored, Tier
from kvctl.core.hashing import local_block_hashes
from kvctl.core.names import SeqMark
from kvctl.server.ingest.decode_process.parent import Decoder, InlineDecoder, ProcessDecoder
from kvctl.server.ingest.zmq_source import EngineStream
from tests.fixtures_path import FIXTURES
from tests.server.zmq_engine import Engine
from tests.support import eventually_async

WORKER_ID = 7
MEDIUM_TIER = {"GPU": Tier.device, "CPU": Tier.host_pinned, "CPU_PINNED": Tier.host_pinned}
# Real events that kvctl refuses: vLLM 0.23's CPU-offload placeholder store (block_size 0).
EXPECTED_ERRORS = {("vllm-legacy/0.23.0", "j_medium_cpu.msgpack"): {0: ErrorKind.bad_block_size}}


# -- fixtures as data ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Capture:
    """One captured message: its payload bytes, topic, dp rank and expected events (by the manifest)."""

    file: str
    topic: str
    payload: bytes
    dp_rank: int
    expected: list[tuple[Any, ...]]
    errors: dict[int, ErrorKind]


def _u64(value: Any) -> int:
    if isinstance(value, dict):
        return int(value["__bytes_hex__"][-16:], 16)
    return value % 2**64


def _expected(ev: dict[str, Any]) -> tuple[Any, ...]:
    if ev["type"] == "AllBlocksCleared":
        return ("Cleared",)
    hashes = [_u64(h) for h in ev["block_hashes"]]
    tier = MEDIUM_TIER[ev["medium"]]
    if ev["type"] == "BlockRemoved":
        return ("Removed", hashes, tier)
    parent = ev["parent_block_hash"]
    return ("Stored", None if parent is None else _u64(parent), hashes, tier)


def _shape(event: EventData) -> tuple[Any, ...]:
    """What the tests compare of a delivered event: its kind, block hashes, parent and tier."""
    if isinstance(event, Stored):
        return ("Stored", event.parent_hash, list(event.block_hashes), event.tier)  # the decode process packs them
    if isinstance(event, Removed):
        return ("Removed", list(event.block_hashes), event.tier)
    assert isinstance(event, Cleared)
    return ("Cleared",)


def load(folder: str) -> list[Capture]:
    manifest = json.loads((FIXTURES / folder / "manifest.json").read_text())
    captures = []
    for msg in manifest["messages"]:
        decoded = msg["decoded_expectation"]
        errors = EXPECTED_ERRORS.get((folder, msg["file"]), {})
        captures.append(
            Capture(
                file=msg["file"],
                topic=msg["topic"],
                payload=(FIXTURES / folder / msg["file"]).read_bytes(),
                dp_rank=next(v for k, v in decoded.items() if k.endswith("rank")),
                expected=[_expected(ev) for i, ev in enumerate(decoded["events"]) if i not in errors],
                errors=errors,
            )
        )
    return captures


# -- the engine side ----------------------------------------------------------------------------


@dataclass
class Harness:
    """An engine, a stream subscribed to it, and what reached the sink and on_restart."""

    engine: Engine
    stream: EngineStream
    task: asyncio.Task[None]
    delivered: list[tuple[tuple[int, int], list[EventData]]]
    restarts: list[tuple[int, int]]
    marks: list[SeqMark | None]
    base: int = 0

    def shapes(self) -> list[tuple[Any, ...]]:
        return [_shape(ev) for _, events in self.delivered for ev in events]

    async def wait(self, condition: Callable[[], bool], timeout: float = 3.0) -> None:
        await eventually_async(lambda: self.stream.stats, "the condition", until=lambda _: condition(),
                               timeout=timeout, interval=0.005)

    async def start(self, seq: int, payload: bytes, topic: str = "") -> None:
        """Publish the first message once the stream's subscription has reached the engine."""
        await self.engine.subscribed()
        await self.engine.publish(seq, payload, topic)
        await self.wait(lambda: self.stream.stats.messages == 1 and self.stream.stats.batches_applied == 1)
        self.base = self.stream.stats.messages

    async def received(self, messages: int) -> None:
        """Wait until the stream has received `messages` live messages after the probe."""
        await self.wait(lambda: self.stream.stats.messages >= self.base + messages)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(params=["inline", "process"])
async def decoder(request: pytest.FixtureRequest) -> AsyncIterator[Decoder]:
    """Every behaviour holds whether payloads are decoded in the loop or by the decode process."""
    chosen = InlineDecoder() if request.param == "inline" else ProcessDecoder()
    yield chosen
    await chosen.close()


@pytest.fixture
async def make(ctx: zmq.asyncio.Context, decoder: Decoder) -> AsyncIterator[Callable[..., Any]]:
    """Build harnesses; at teardown every stream is closed and must not have died of an exception."""
    harnesses: list[Harness] = []

    async def factory(*, replay: bool = True, timeout: float = 2.0, resume_seq: int | None = None,
                      dp_rank: int = 0, **engine_kw: Any) -> Harness:
        engine = Engine(ctx, **engine_kw)
        delivered: list[tuple[tuple[int, int], list[EventData]]] = []
        restarts: list[tuple[int, int]] = []
        marks: list[SeqMark | None] = []

        def sink(key: tuple[int, int], events: list[EventData], mark: SeqMark | None) -> None:
            delivered.append((key, events))
            marks.append(mark)

        stream = EngineStream(
            (WORKER_ID, dp_rank),
            engine.endpoint,
            engine.replay_endpoint if replay else None,
            block_size=16,
            sink=sink,
            on_restart=restarts.append,
            replay_timeout_s=timeout,
            clock=lambda: 1234.5,
            context=ctx,
            decoder=decoder,
            resume_seq=resume_seq,
        )
        harness = Harness(engine, stream, asyncio.ensure_future(stream.run()), delivered, restarts, marks)
        harnesses.append(harness)
        return harness

    yield factory
    for h in harnesses:
        await h.stream.aclose()
        assert h.task.done()
        h.task.result()
        await h.engine.close()


def _events_of(captures: list[Capture]) -> list[tuple[Any, ...]]:
    return [ev for c in captures for ev in c.expected]


# -- in order -----------------------------------------------------------------------------------


@pytest.mark.parametrize("folder", ["vllm-0.33", "sglang-0.5.23", "vllm-legacy/0.23.0", "vllm-legacy/0.10.2"])
async def test_in_order_messages_reach_the_sink_as_the_manifest_says(make: Any, folder: str) -> None:
    captures = load(folder)
    h = await make()
    await h.start(0, captures[0].payload, captures[0].topic)
    for seq, capture in enumerate(captures[1:], start=1):
        await h.engine.publish(seq, capture.payload, capture.topic)
    await h.wait(lambda: h.stream.stats.batches_applied == len(captures))

    assert h.shapes() == _events_of(captures)
    # One sink call per batch with events, keyed by the payload's own dp rank (not the registered 0).
    assert [key for key, _ in h.delivered] == [(WORKER_ID, c.dp_rank) for c in captures if c.expected]
    stats = h.stream.stats
    assert stats.last_seq == len(captures) - 1
    assert stats.events == len(_events_of(captures))
    assert (stats.gaps, stats.lost_batches, stats.restarts, stats.gapped) == (0, 0, 0, False)
    assert stats.decode_errors == {
        kind.value: 1 for c in captures for kind in c.errors.values()
    }  # one real bad event at most per folder here
    assert stats.last_event_at == 1234.5 and stats.last_message_at == 1234.5
    schema = stats.schema
    assert schema.event_shapes == ({"array"} if folder.startswith("vllm-legacy") else {"map"})
    assert schema.dp_ranks == {c.dp_rank for c in captures}
    assert 16 in schema.block_sizes
    assert Tier.device.value in schema.tiers
    assert "GPU" in schema.media


async def test_schema_tells_engines_apart(make: Any) -> None:
    """SGLang's signed hashes and CPU_PINNED medium; vLLM's bytes hashes and its CPU tier."""
    sglang, vllm = load("sglang-0.5.23"), load("vllm-0.33")
    h = await make()
    await h.start(0, sglang[0].payload)
    pinned = next(c for c in sglang if c.file.startswith("j_"))
    raw = [c for c in vllm if c.file.startswith(("g_", "j_"))]
    for seq, capture in enumerate([pinned, *raw], start=1):
        await h.engine.publish(seq, capture.payload)
    await h.wait(lambda: h.stream.stats.batches_applied == 4)
    schema = h.stream.stats.schema
    assert schema.hash_kinds == {"u64", "i64", "bytes"}
    assert schema.media == {"GPU", "CPU_PINNED", "CPU"}
    assert schema.tiers == {"device", "host_pinned"}


# -- gaps and replay ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("folder", "topic_frame"), [("vllm-0.33", True), ("sglang-0.5.23", True), ("vllm-legacy/0.23.0", False)]
)
async def test_gap_is_repaired_by_replay_and_live_messages_wait_for_it(
    make: Any, folder: str, topic_frame: bool
) -> None:
    a, b, c, d, e = load(folder)[:5]  # store, chained store, remove, clear, mixed
    h = await make(topic_frame=topic_frame)
    h.engine.release.clear()  # the engine holds its replay until the live message below is in
    await h.start(0, a.payload)
    await h.engine.publish(1, b.payload, live=False)  # lost on the wire
    await h.engine.publish(2, c.payload, live=False)
    await h.engine.publish(3, d.payload)  # the gap shows
    await h.wait(h.engine.request_seen.is_set)
    assert h.engine.requests == [1]
    await h.engine.publish(4, e.payload)  # live, during the replay
    await h.received(2)
    assert h.stream.stats.replaying
    assert h.shapes() == _events_of([a])  # nothing past the gap yet: d and e are buffered
    h.engine.release.set()
    await h.wait(lambda: h.stream.stats.last_seq == 4 and not h.stream.stats.replaying)

    assert h.shapes() == _events_of([a, b, c, d, e])
    stats = h.stream.stats
    assert (stats.gaps, stats.replays_ok, stats.replays_failed, stats.lost_batches) == (1, 1, 0, 0)
    assert stats.gapped is False
    assert stats.batches_applied == 5
    assert stats.duplicates >= 2  # the engine replayed 3 and 4 too; the buffered live copies won


async def test_without_a_replay_endpoint_the_gap_is_lost_and_the_stream_goes_on(make: Any) -> None:
    a, b, c, d, e = load("vllm-0.33")[:5]
    h = await make(replay=False)
    await h.start(0, a.payload)
    await h.engine.publish(1, b.payload, live=False)
    await h.engine.publish(2, c.payload, live=False)
    await h.engine.publish(3, d.payload)
    await h.engine.publish(4, e.payload)
    await h.wait(lambda: h.stream.stats.last_seq == 4)

    assert h.shapes() == _events_of([a, d, e])
    stats = h.stream.stats
    assert (stats.gaps, stats.lost_batches, stats.gapped) == (1, 2, True)
    assert (stats.replays_ok, stats.replays_failed) == (0, 0)
    assert h.engine.requests == []


async def test_replay_timeout_counts_a_failure_then_a_later_gap_still_replays(make: Any) -> None:
    a, b, c, d, e = load("vllm-0.33")[:5]
    h = await make(timeout=0.3, mute=True)
    await h.start(0, a.payload)
    await h.engine.publish(1, b.payload, live=False)
    await h.engine.publish(2, c.payload)
    await h.engine.publish(3, d.payload)  # buffered while the replay waits
    await h.wait(lambda: h.stream.stats.replays_failed == 1, timeout=3.0)
    await h.wait(lambda: h.stream.stats.last_seq == 3)

    assert h.engine.requests == [1]
    assert h.shapes() == _events_of([a, c, d])
    stats = h.stream.stats
    assert (stats.gaps, stats.replays_failed, stats.replays_ok, stats.lost_batches, stats.gapped) == (1, 1, 0, 1, True)

    # The engine answers again: a fresh DEALER asks for the next gap and gets it.
    h.engine.mute = False
    await h.engine.publish(4, e.payload, live=False)
    await h.engine.publish(5, a.payload)
    await h.wait(lambda: h.stream.stats.last_seq == 5 and not h.stream.stats.replaying)
    assert h.engine.requests == [1, 4]
    assert h.shapes() == _events_of([a, c, d, e, a])
    stats = h.stream.stats
    assert (stats.gaps, stats.replays_ok, stats.replays_failed, stats.lost_batches) == (2, 1, 1, 1)


async def test_replay_that_no_longer_holds_the_gap_counts_it_lost(make: Any) -> None:
    a, b, c, d, _ = load("vllm-0.33")[:5]
    h = await make()
    await h.start(0, a.payload)
    await h.engine.publish(1, b.payload, live=False)
    h.engine.buffer.pop()  # the engine's replay buffer has already dropped seq 1
    await h.engine.publish(2, c.payload)
    await h.engine.publish(3, d.payload)
    await h.wait(lambda: h.stream.stats.last_seq == 3 and not h.stream.stats.replaying)

    assert h.shapes() == _events_of([a, c, d])
    stats = h.stream.stats
    assert (stats.replays_ok, stats.replays_failed, stats.lost_batches, stats.gapped) == (0, 1, 1, True)


# -- resumed after a router restart ------------------------------------------------------------


def _sid(h: Harness) -> tuple[tuple[int, int], str]:
    return (WORKER_ID, 0), h.engine.endpoint


async def test_a_resumed_stream_asks_the_replay_at_once_for_what_came_after_its_seq(make: Any) -> None:
    """The router restarted on a state dir that holds this stream up to seq 2; the engine published 3..5 while it
    was down. They are asked for before any live message comes, and applied in order; then live goes on."""
    a, b, c, d, e = load("vllm-0.33")[:5]
    h = await make(resume_seq=2)
    for seq, capture in enumerate([a, b, c, d, e, a]):  # 0..2 are in the router's index already
        await h.engine.publish(seq, capture.payload, live=False)
    await h.wait(lambda: h.stream.stats.last_seq == 5 and not h.stream.stats.replaying)
    assert h.engine.requests == [3]
    assert h.shapes() == _events_of([d, e, a])
    assert h.marks == [(_sid(h), 3), (_sid(h), 4), (_sid(h), 5)]
    stats = h.stream.stats
    assert (stats.resumed_from, stats.gaps, stats.replays_ok, stats.replays_failed, stats.lost_batches,
            stats.gapped) == (2, 0, 1, 0, 0, False)

    await h.engine.subscribed()
    await h.engine.publish(6, b.payload)
    await h.wait(lambda: h.stream.stats.last_seq == 6)
    assert h.marks[-1] == (_sid(h), 6) and h.stream.stats.gaps == 0 and h.restarts == []


async def test_a_resumed_stream_whose_engine_restarted_meanwhile_is_cleared_not_gapped(make: Any) -> None:
    """Its engine restarted while the router was down: nothing after seq 9 to replay, and its first live seq is
    at or below 9. That is the engine's restart (its worker cleared, its new seqs replayed from 0), not a gap."""
    a, b = load("vllm-0.33")[:2]
    h = await make(resume_seq=9)
    await h.engine.publish(0, a.payload, live=False)  # the new engine's first batch, before we connected
    await h.wait(lambda: h.engine.requests == [10] and not h.stream.stats.replaying)
    assert h.shapes() == []
    await h.engine.subscribed()
    await h.engine.publish(1, b.payload)
    await h.wait(lambda: h.stream.stats.last_seq == 1 and not h.stream.stats.replaying)
    assert h.restarts == [(WORKER_ID, 0)]
    assert h.engine.requests == [10, 0]
    assert h.shapes() == _events_of([a, b])
    stats = h.stream.stats
    assert (stats.restarts, stats.lost_batches, stats.gapped) == (1, 0, False)


async def test_a_resumed_stream_whose_replay_does_not_answer_waits_at_its_seq(make: Any) -> None:
    """No answer (the engine not up yet) and nothing live: nothing is known lost, no replay is counted failed;
    the stream waits at its seq, and the next live message is in order."""
    a = load("vllm-0.33")[0]
    h = await make(resume_seq=4, mute=True, timeout=0.2)
    await h.wait(lambda: h.engine.requests == [5] and not h.stream.stats.replaying)
    stats = h.stream.stats
    assert (stats.replays_failed, stats.lost_batches, stats.gapped, stats.last_seq) == (0, 0, False, 4)
    await h.engine.subscribed()
    await h.engine.publish(5, a.payload)
    await h.wait(lambda: h.stream.stats.last_seq == 5)
    assert h.shapes() == _events_of([a])
    assert (h.stream.stats.gaps, h.engine.requests) == (0, [5])


async def test_a_resumed_stream_counts_lost_what_the_replay_no_longer_holds(make: Any) -> None:
    a, b = load("vllm-0.33")[:2]
    h = await make(resume_seq=2)
    await h.engine.publish(5, a.payload, live=False)  # the engine's buffer starts at 5: 3 and 4 are gone
    await h.engine.publish(6, b.payload, live=False)
    await h.wait(lambda: h.stream.stats.last_seq == 6 and not h.stream.stats.replaying)
    assert h.engine.requests == [3]
    assert h.shapes() == _events_of([a, b])
    stats = h.stream.stats
    assert (stats.lost_batches, stats.gapped, stats.replays_failed, stats.replays_ok) == (2, True, 1, 0)


# -- restarts, duplicates, bad input ------------------------------------------------------------


async def test_seq_going_back_is_a_restart(make: Any) -> None:
    a, b, c, d, e = load("vllm-0.33")[:5]
    h = await make(replay=False)
    await h.start(5, a.payload)
    await h.engine.publish(6, b.payload)
    await h.engine.publish(8, c.payload)  # a lost batch: gapped until the restart
    await h.wait(lambda: h.stream.stats.last_seq == 8)
    assert h.stream.stats.gapped and h.restarts == []

    await h.engine.publish(0, d.payload)  # the engine restarted
    await h.engine.publish(1, e.payload)
    await h.wait(lambda: h.stream.stats.last_seq == 1)

    assert h.restarts == [(WORKER_ID, 0)]
    assert h.shapes() == _events_of([a, b, c, d, e])
    stats = h.stream.stats
    assert (stats.restarts, stats.gapped, stats.gaps, stats.lost_batches) == (1, False, 1, 1)


async def test_restart_during_a_replay_abandons_it(make: Any) -> None:
    a, b, c, d, e = load("vllm-0.33")[:5]
    h = await make(mute=True, timeout=5.0)
    await h.start(10, a.payload)
    await h.engine.publish(11, b.payload, live=False)
    await h.engine.publish(12, c.payload)  # gap: replay asked, never answered
    await h.wait(h.engine.request_seen.is_set)
    await h.engine.publish(0, d.payload)  # the engine restarted meanwhile
    await h.engine.publish(1, e.payload)
    await h.wait(lambda: h.stream.stats.last_seq == 1)

    assert h.restarts == [(WORKER_ID, 0)]
    assert h.shapes() == _events_of([a, d, e])  # seq 12 belonged to the old engine's lost history
    stats = h.stream.stats
    assert (stats.restarts, stats.replaying, stats.gapped) == (1, False, False)


async def test_a_burst_is_applied_in_order_without_gaps(make: Any) -> None:
    captures = load("vllm-0.33")
    h = await make()
    await h.start(0, captures[0].payload)
    n = 3000
    for seq in range(1, n + 1):
        await h.engine.publish(seq, captures[seq % len(captures)].payload, live=True)
    await h.wait(lambda: h.stream.stats.last_seq == n, timeout=10.0)
    stats = h.stream.stats
    assert (stats.batches_applied, stats.gaps, stats.lost_batches) == (n + 1, 0, 0)
    assert stats.events == sum(len(captures[s % len(captures)].expected) for s in range(n + 1))


async def test_a_batch_naming_no_rank_is_its_streams_and_one_naming_a_rank_that_ranks(make: Any) -> None:
    """As Dynamo's listener takes them: a nil rank is the registered one (here 2); a named rank wins."""
    a = load("vllm-0.33")[0]
    f = next(c for c in load("vllm-0.33") if c.file.startswith("f_"))  # data_parallel_rank 1
    ts, events, _ = msgspec.msgpack.decode(a.payload)
    h = await make(dp_rank=2)
    await h.start(0, msgspec.msgpack.encode([ts, events, None]))
    await h.engine.publish(1, f.payload)
    await h.wait(lambda: len(h.delivered) == 2)
    assert [key for key, _ in h.delivered] == [(WORKER_ID, 2), (WORKER_ID, 1)]
    assert h.stream.stats.schema.dp_ranks == {1, 2}


async def test_a_salted_requests_later_chunk_inherits_its_salt_whichever_decoder(make: Any) -> None:
    """vLLM behind Dynamo names a request's salt in its first block only: the chunk stored next comes unsalted, and
    is hashed under its parent's salt, as Dynamo's indexer does (v7 of the 0.34 streams, worker 1)."""
    lines = [json.loads(line) for line in (FIXTURES / "engine-streams" / "vllm-0.34" /
                                           "v7_dynamo_cache_salt_chunked.jsonl").read_text().splitlines()]
    first, second = (bytes.fromhex(m["payload_hex"]) for m in lines if m["worker"] == 1 and m["seq"] in (0, 1))
    tokens = [t for m in lines if m["worker"] == 1 for e in m["wire_untyped"][1] for t in e["token_ids"]][:320]
    ts, events, rank = msgspec.msgpack.decode(first)
    both = msgspec.msgpack.encode([ts, [*events, *msgspec.msgpack.decode(second)[1]], rank])  # one scheduler step
    salted = local_block_hashes(tokens, 16, cache_salt="tenant-42")
    for payloads in ([first, second], [both]):
        h = await make()
        await h.start(0, payloads[0])
        for seq, payload in enumerate(payloads[1:], 1):
            await h.engine.publish(seq, payload)
        await h.wait(lambda h=h: sum(map(len, (events for _, events in h.delivered))) == 2)
        stored = [event for _, events in h.delivered for event in events]
        assert [list(e.tokens_hashes) for e in stored if isinstance(e, Stored)] == [salted[:12], salted[12:]]
        assert [(e.salt, e.rehash) for e in stored if isinstance(e, Stored)] == [("tenant-42", None)] * 2
        assert h.stream.drops.normalizer.dropped == {}


async def test_restart_clears_every_dp_rank_the_stream_fed(make: Any) -> None:
    vllm = load("vllm-0.33")
    a = vllm[0]
    f = next(c for c in vllm if c.file.startswith("f_"))  # data_parallel_rank 1
    h = await make()
    await h.start(3, a.payload)
    await h.engine.publish(4, f.payload, "kv-events")
    await h.engine.publish(0, a.payload)
    await h.wait(lambda: h.stream.stats.restarts == 1 and h.stream.stats.last_seq == 0)
    assert sorted(h.restarts) == [(WORKER_ID, 0), (WORKER_ID, 1)]
    assert h.engine.requests == []


async def test_the_same_live_seq_again_is_a_restart(make: Any) -> None:
    """A PUB never sends a seq twice and ZMQ delivers each once: seq 0 again, even right after the first batch,
    is a restarted engine (the one set of sequence rules, told the transport delivers once)."""
    a, b, *_ = load("sglang-0.5.23")
    h = await make()
    await h.start(0, a.payload)
    await h.engine.send_raw([b"", (0).to_bytes(8, "big"), b.payload])
    await h.wait(lambda: h.stream.stats.restarts == 1 and h.stream.stats.events == len(_events_of([a, b])))
    assert h.restarts == [(WORKER_ID, 0)]
    assert h.shapes() == _events_of([a, b])
    assert h.stream.stats.duplicates == 0 and h.stream.stats.gaps == 0


@pytest.mark.parametrize("absurd", [2**64 - 1, 2**33])
async def test_a_seq_jump_past_2_32_is_counted_and_the_stream_keeps_its_place(make: Any, absurd: int) -> None:
    """A jump to 2^64 - 1 once counted 2^64 lost batches (lost_batches read 27670116110564327476 after
    a few) and asked for a replay of them; now it is a jump: applied, and the next seq is in order."""
    a, b, c, d = load("vllm-0.33")[:4]
    h = await make()
    await h.start(0, a.payload)
    await h.engine.publish(absurd, b.payload)
    await h.engine.publish(1, c.payload)
    await h.engine.publish(absurd, d.payload)
    await h.engine.publish(2, a.payload)
    await h.wait(lambda: h.stream.stats.last_seq == 2)
    assert h.shapes() == _events_of([a, b, c, d, a])
    assert h.marks == [(_sid(h), 0), None, (_sid(h), 1), None, (_sid(h), 2)]  # a restart resumes at its place
    stats = h.stream.stats
    assert (stats.jumps, stats.lost_batches, stats.gaps, stats.restarts, stats.gapped) == (2, 0, 0, 0, False)
    assert h.engine.requests == [] and h.restarts == []


async def test_malformed_messages_are_counted_and_skipped(make: Any) -> None:
    vllm = load("vllm-0.33")
    a, b, e = vllm[0], vllm[1], vllm[4]
    wire = msgspec.msgpack.decode(e.payload)  # the real mixed batch, with two bad events spliced in
    good_store, good_remove, good_clear = wire[1]
    wire[1] = [
        good_store,
        {"type": "BlockFrobbed"},
        good_remove,
        {"type": "BlockRemoved", "block_hashes": ["not-a-hash"], "medium": "GPU"},
        good_clear,
    ]
    h = await make()
    await h.start(0, a.payload)
    await h.engine.publish(1, b"\xc1 garbage, not msgpack")
    await h.engine.publish(2, msgspec.msgpack.encode(wire))
    await h.engine.send_raw([b"", b"short"])  # two frames: no seq to read
    await h.engine.send_raw([b"", b"\x00" * 3, b.payload])  # a 3-byte seq
    await h.engine.publish(3, b.payload)
    await h.wait(lambda: h.stream.stats.last_seq == 3)

    assert h.shapes() == _events_of([a, e, b])  # the mixed batch lost only its two bad events
    stats = h.stream.stats
    assert stats.decode_errors == {"bad_msgpack": 1, "unknown_type": 1, "bad_hash": 1, "bad_batch": 2}
    # A bad payload still consumed its seq: no gap, no pointless replay.
    assert (stats.gaps, stats.gapped, stats.batches_applied) == (0, False, 4)
    assert h.engine.requests == []


async def test_real_bad_event_of_vllm_0_23_offload_is_counted(make: Any) -> None:
    legacy = load("vllm-legacy/0.23.0")
    a, j = legacy[0], next(c for c in legacy if c.file.startswith("j_"))
    h = await make()
    await h.start(0, a.payload)
    await h.engine.publish(1, j.payload)
    await h.wait(lambda: h.stream.stats.last_seq == 1)
    assert h.shapes() == _events_of([a, j]) and h.shapes()[-1][0] == "Removed"
    assert h.stream.stats.decode_errors == {"bad_block_size": 1}


async def test_a_block_size_past_u32_costs_one_event_and_never_the_stream(make: Any, decoder: Decoder) -> None:
    """A store with no blocks and a block size of 2^62 (map and positional forms) once raised OverflowError
    in the hashing: the decode process died with the good event beside it, the inline stream stopped."""
    a, b, c = load("vllm-0.33")[:3]
    good_store = msgspec.msgpack.decode(b.payload)[1][0]
    absurd = [{"type": "BlockStored", "block_hashes": [], "parent_block_hash": None, "token_ids": [],
               "block_size": 2**62}, ["BlockStored", [], None, [], 2**62]]
    h = await make()
    await h.start(0, a.payload)
    await h.engine.publish(1, msgspec.msgpack.encode([1.0, [absurd[0], good_store], 0]))
    await h.engine.publish(2, msgspec.msgpack.encode([1.0, [absurd[1]], 0]))
    await h.engine.publish(3, c.payload)
    await h.wait(lambda: h.stream.stats.last_seq == 3)

    assert h.shapes() == [*_events_of([a]), _expected(good_store), *_events_of([c])]
    assert h.stream.stats.decode_errors == {"bad_block_size": 2}
    assert decoder.status().get("failed") is None


@pytest.mark.parametrize("decoder", ["process"], indirect=True)
async def test_a_killed_decode_process_hands_the_stream_back_and_the_gap_is_replayed(
    make: Any, decoder: ProcessDecoder
) -> None:
    """What the decode process had received and not sent dies with it: the stream opens its own socket,
    and the first message there shows the gap, which the engine's replay fills."""
    a, b, c, d, e = load("vllm-0.33")[:5]
    h = await make()
    await h.start(0, a.payload)
    await h.engine.publish(1, b.payload)
    await h.wait(lambda: h.stream.stats.last_seq == 1)
    assert h.stream._io.sub is None and decoder.status()["receiving"] == 1
    h.engine.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # pass on the stream's subscription, a duplicate of the child's
    os.kill(decoder.status()["pid"], signal.SIGKILL)
    await h.wait(lambda: h.stream._io.sub is not None)
    while (await asyncio.wait_for(h.engine.pub.recv(), 3))[:1] != b"\x01":
        pass  # the dead child's unsubscription, if it comes first
    await h.engine.publish(2, c.payload, live=False)  # as if it had died holding this one
    await h.engine.publish(3, d.payload)
    await h.engine.publish(4, e.payload)
    await h.wait(lambda: h.stream.stats.last_seq == 4 and not h.stream.stats.replaying)

    assert h.shapes() == _events_of([a, b, c, d, e])
    stats = h.stream.stats
    assert (stats.gaps, stats.replays_ok, stats.lost_batches, stats.gapped) == (1, 1, 0, False)
    assert decoder.status()["receiving"] == 0 and decoder.status()["last_error"]


# -- lifecycle ----------------------------------------------------------------------------------


async def test_close_is_prompt_and_closes_the_sockets(make: Any, decoder: Decoder) -> None:
    h = await make()
    await h.start(0, load("vllm-0.33")[0].payload)
    sub = h.stream._io.sub  # the stream's own, or none while the decode process receives for it
    assert (sub is None) == isinstance(decoder, ProcessDecoder)
    assert sub is None or not sub.closed
    assert decoder.status().get("receiving", 0) == (1 if sub is None else 0)
    h.stream.close()  # synchronous: the daemon calls it from its shutdown path
    await asyncio.wait_for(h.task, 10)  # a bound on a hang, not a figure: run() sees the close and returns
    assert h.task.exception() is None  # run() ended normally, not cancelled
    assert (sub is None or sub.closed) and h.stream._io.sub is None and h.stream._io.dealer is None
    assert decoder.status().get("receiving", 0) == 0
    h.stream.close()  # idempotent
    await h.stream.aclose()


async def test_close_during_a_replay_and_before_run(make: Any, ctx: zmq.asyncio.Context) -> None:
    a, b, c, *_ = load("vllm-0.33")
    h = await make(mute=True, timeout=60.0)
    await h.start(0, a.payload)
    await h.engine.publish(1, b.payload, live=False)
    await h.engine.publish(2, c.payload)
    await h.wait(h.engine.request_seen.is_set)
    assert h.stream.stats.replaying
    await asyncio.wait_for(h.stream.aclose(), 10)  # not the replay's 60 s timeout: the close ends the replay
    assert h.task.done() and h.stream._io.dealer is None

    never = EngineStream((1, 0), "tcp://127.0.0.1:9", None, block_size=16, sink=print, on_restart=print, context=ctx)
    never.close()
    await asyncio.wait_for(never.run(), 0.5)  # returns at once: closed before it ran
    assert never.stats.messages == 0 and never._io.sub is None


async def test_close_called_from_the_sink_ends_run_after_that_batch(ctx: zmq.asyncio.Context) -> None:
    a, b = load("vllm-0.33")[:2]
    engine = Engine(ctx)
    seen: list[int] = []

    def sink(key: tuple[int, int], events: list[EventData], mark: SeqMark | None) -> None:
        seen.append(len(events))
        stream.close()  # inside run(): no cancellation, run() returns after this batch

    stream = EngineStream((1, 0), engine.endpoint, None, block_size=16, sink=sink, on_restart=print, context=ctx)
    task = asyncio.ensure_future(stream.run())
    try:
        await engine.subscribed()
        await engine.send_raw([b"", (0).to_bytes(8, "big"), a.payload])
        await engine.send_raw([b"", (1).to_bytes(8, "big"), b.payload])
        await eventually_async(task.done, "run() to return", timeout=3, interval=0.01)
        assert task.exception() is None and seen == [1] and stream._io.sub is None
    finally:
        await engine.close()


async def test_constructor_rejects_bad_settings() -> None:
    with pytest.raises(ValueError):
        EngineStream((1, 0), "tcp://127.0.0.1:9", None, block_size=0, sink=print, on_restart=print)
    with pytest.raises(ValueError):
        EngineStream((1, 0), "tcp://127.0.0.1:9", None, block_size=16, sink=print, on_restart=print, replay_timeout_s=0)
