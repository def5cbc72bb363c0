"""The decode process gives back exactly what decoding in the loop gives, in submission order, and losing
it (killed mid-stream) loses nothing: what it had not answered is decoded in the router instead."""

from __future__ import annotations

import asyncio
import os
import signal
from array import array
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvctl.core.events import Cleared, EngineBatch, ErrorKind, Removed, Stored, live_seq
from kvctl.server.ingest.decode_process import parent as decoder_module
from kvctl.server.ingest.decode_process.parent import (
    InlineDecoder,
    NeverFull,
    ProcessDecoder,
    Subscription,
    decode_now,
    make_decoder,
)
from kvctl.server.ingest.decode_process.wire import answer, live_answer, read_answer, split_answers
from kvctl.server.ingest.schema_seen import facts_of
from tests.fixtures_path import FIXTURES
from tests.plain_events import plain
from tests.support import eventually_async

PAYLOADS = [p.read_bytes() for folder in ("vllm-0.33", "sglang-0.5.23", "vllm-legacy/0.23.0")
            for p in sorted((FIXTURES / folder).glob("*.msgpack"))]
JUNK = [b"", b"\xc1", b"\x93\x01\x02", b"\x92\xcb" + b"\0" * 8 + b"\x91\xc0"]


def _same(a: EngineBatch | ErrorKind, b: EngineBatch | ErrorKind) -> bool:
    if isinstance(a, ErrorKind) or isinstance(b, ErrorKind):
        return a == b
    return (a.ts, a.dp_rank, list(map(plain, a.events)), [e.kind for e in a.errors]) == (
        b.ts, b.dp_rank, list(map(plain, b.events)), [e.kind for e in b.errors])


@pytest.fixture
async def process() -> AsyncIterator[ProcessDecoder]:
    decoder = ProcessDecoder(max_pending=64)
    yield decoder
    await decoder.close()


def test_the_pipe_codec_round_trips_every_fixture_and_junk() -> None:
    assert len(PAYLOADS) > 20
    kinds = set()
    for payload in PAYLOADS + JUNK:
        wire = bytearray(answer(payload, 16))
        (got,) = split_answers(wire)
        assert not wire
        assert _same(got, decode_now(payload, 16)), payload
        for event in got.events if isinstance(got, EngineBatch) else ():
            # what the index reads per block comes packed, as it keeps them: no int per block
            if isinstance(event, Stored):
                assert type(event.tokens_hashes) is array and type(event.block_hashes) is array
            elif isinstance(event, Removed):
                assert type(event.block_hashes) is array
            kinds.add(type(event))
    assert kinds == {Stored, Removed, Cleared}


def test_live_messages_cross_the_pipe_as_the_router_would_read_them() -> None:
    """What the decode process receives for a stream comes back as the stream would have read it itself:
    the seq, the decoded batch or the error kind, and what the payload shows of the schema when asked to sample
    it (so that the router does not read the payload again)."""
    seq = (7).to_bytes(8, "big")
    cases = [[b"", seq, p] for p in PAYLOADS + JUNK] + [
        [b"\xff\xfe", seq, PAYLOADS[0]],  # a topic that is not UTF-8: the seq still counts
        [b"", b"\x01", PAYLOADS[0]],  # a seq that is not 8 bytes
        [b"", seq],  # two frames
    ]
    wire = bytearray()
    for i, frames in enumerate(cases):
        wire += live_answer(3, frames, 16, sample=i % 2 == 0, keep_tokens=False)[0]
        if i == 5:
            wire += answer(PAYLOADS[1], 16)  # a request's answer in between keeps its place
    got = split_answers(wire)
    assert not wire and len(got) == len(cases) + 1
    assert _same(got.pop(6), decode_now(PAYLOADS[1], 16))
    for i, (frames, live) in enumerate(zip(cases, got, strict=True)):
        assert isinstance(live, tuple)
        key, seq, seen, result = live
        assert key == 3
        assert seq == live_seq(frames) == (None if i >= len(cases) - 2 else 7)
        if seq is None or frames[0] == b"\xff\xfe":
            assert result is ErrorKind.bad_batch
        else:
            assert _same(result, decode_now(frames[2], 16)), frames
        assert seen == (facts_of(frames[2]) if i % 2 == 0 and seq is not None else None)


def test_a_partial_answer_waits_for_the_rest() -> None:
    wire = bytearray(answer(PAYLOADS[0], 16) + answer(PAYLOADS[1], 16))
    head, tail = wire[:10], wire[10:]
    assert split_answers(head) == [] and len(head) == 10
    head += tail
    assert len(split_answers(head)) == 2 and not head
    assert read_answer([ErrorKind.bad_msgpack.value]) is ErrorKind.bad_msgpack


async def test_answers_and_callbacks_come_back_in_submission_order(process: ProcessDecoder) -> None:
    inputs = (PAYLOADS + JUNK) * 20  # more than max_pending: `full` must turn on and off again
    got: list[tuple[int, EngineBatch | ErrorKind]] = []
    marks: list[int] = []
    saw_full = False
    for i, payload in enumerate(inputs):
        if process.full:
            saw_full = True
            await process.room()
        process.submit(payload, 16, lambda result, i=i: got.append((i, result)))
        if i % 50 == 0:
            process.then(lambda n=i: marks.append(len(got) - 1 == n and n))
    await asyncio.wait_for(process.drained(), 10)
    assert saw_full
    assert [i for i, _ in got] == list(range(len(inputs)))
    assert all(_same(r, decode_now(inputs[i], 16)) for i, r in got)
    assert marks == list(range(0, len(inputs), 50))  # each ran right after the answer before it
    assert process.status()["decoded"] == len(inputs) and process.status()["failed"] is None


async def test_a_killed_decode_process_loses_nothing(process: ProcessDecoder) -> None:
    got: list[int] = []
    results: list[EngineBatch | ErrorKind] = []

    def keep(i: int) -> object:
        return lambda result: (got.append(i), results.append(result))

    for i in range(40):
        process.submit(PAYLOADS[i % len(PAYLOADS)], 16, keep(i))
    pid = process.status()["pid"]
    os.kill(pid, signal.SIGKILL)
    for i in range(40, 80):  # submitted while it dies, and after
        process.submit(PAYLOADS[i % len(PAYLOADS)], 16, keep(i))
        await asyncio.sleep(0)
    await eventually_async(process.status, "the decode process's death noticed",
                           until=lambda s: s["last_error"] is not None, interval=0.01)
    await asyncio.wait_for(process.drained(), 10)
    for i in range(80, 90):
        process.submit(PAYLOADS[i % len(PAYLOADS)], 16, keep(i))
    assert got == list(range(90))
    assert all(_same(r, decode_now(PAYLOADS[i % len(PAYLOADS)], 16)) for i, r in enumerate(results))
    assert "exited" in process.status()["last_error"] or "cannot" in process.status()["last_error"]


async def test_a_dead_decode_process_is_started_again_after_a_backoff() -> None:
    """It once stayed gone for the router's lifetime, everything decoded in the router's loop from then on."""
    process = ProcessDecoder(respawn_min_s=0.05)
    try:
        first = process.status()["pid"]
        os.kill(first, signal.SIGKILL)
        status = await eventually_async(process.status, "a restart", until=lambda s: s["restarts"] > 0,
                                        interval=0.01)
        assert status["failed"] is None and status["pid"] not in (None, first) and "exited" in status["last_error"]
        got: list[EngineBatch | ErrorKind] = []
        decoded = status["decoded"]
        process.submit(PAYLOADS[0], 16, got.append)
        await asyncio.wait_for(process.drained(), 10)
        assert _same(got[0], decode_now(PAYLOADS[0], 16)) and process.status()["decoded"] == decoded + 1
    finally:
        await process.close()


async def test_a_stream_the_child_cannot_subscribe_for_is_handed_back_and_the_child_carries_on(
    process: ProcessDecoder,
) -> None:
    lost: list[str] = []

    def subscription(endpoint: str) -> Subscription:
        return Subscription(endpoint, "", 1000, 16, lambda *_: None, lost.append, NeverFull())

    assert process.receive(subscription("inproc://engine")) is None  # the router's own context: not the child's
    assert process.receive(subscription("tcp://no-port")) is not None
    await eventually_async(lambda: lost, "the stream handed back", interval=0.01)
    assert len(lost) == 1 and lost[0].startswith("cannot subscribe to tcp://no-port: Invalid argument")
    assert process.status()["receiving"] == 0 and process.status()["failed"] is None
    got: list[EngineBatch | ErrorKind] = []
    process.submit(PAYLOADS[0], 16, got.append)
    await asyncio.wait_for(process.drained(), 10)
    assert _same(got[0], decode_now(PAYLOADS[0], 16))


async def test_the_decode_process_is_idle_once_quiet(process: ProcessDecoder) -> None:
    """Messages received for the streams are invisible until read, so idle means a quiet pipe too."""
    assert process.idle()
    got: list[EngineBatch | ErrorKind] = []
    process.submit(PAYLOADS[0], 16, got.append)
    assert not process.idle()  # an answer to wait for
    await asyncio.wait_for(process.drained(), 10)
    assert got and not process.idle()  # just read: a burst may be going on
    await asyncio.sleep(decoder_module.QUIET_S)
    assert process.idle()


async def test_inline_decoder_is_immediate() -> None:
    decoder = InlineDecoder()
    got: list[EngineBatch | ErrorKind] = []
    decoder.submit(JUNK[1], 16, got.append)
    decoder.then(lambda: got.append(ErrorKind.bad_batch))
    assert got == [ErrorKind.bad_msgpack, ErrorKind.bad_batch] and not decoder.full


@pytest.mark.parametrize(("cpus", "cpu_max", "expected"), [
    ({0}, None, InlineDecoder),
    ({0, 1}, None, ProcessDecoder),
    ({2, 5, 7, 9}, "max 100000", ProcessDecoder),
    ({2, 5, 7, 9}, "100000 100000", InlineDecoder),  # a pod limited to one CPU on a big node
    ({2, 5, 7, 9}, "250000 100000", ProcessDecoder),
    ({2, 5, 7, 9}, "garbage", ProcessDecoder),
])
async def test_auto_decodes_in_a_process_only_with_a_second_core_to_run_it(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path, cpus: set[int],
        cpu_max: str | None, expected: type) -> None:
    # the cores this process may be scheduled on (taskset), capped by its cgroup v2 CPU quota
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cpus)
    quota = tmp_path / "cpu.max"
    if cpu_max is not None:
        quota.write_text(cpu_max + "\n")
    monkeypatch.setattr(decoder_module, "CGROUP_CPU_MAX", quota)
    caplog.set_level("INFO", logger="kvctl.serve")
    decoder = make_decoder("auto")
    try:
        assert type(decoder) is expected
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("--decoder auto")]
        assert said == [f"--decoder auto: {'a decode process' if expected is ProcessDecoder else 'inline'} "
                        f"({decoder_module.usable_cpus():g} usable CPUs)"]
        assert type(make_decoder("inline")) is InlineDecoder
    finally:
        await decoder.close()
