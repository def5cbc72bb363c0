"""Recovery against request-plane endpoints that misbehave, over real sockets (issue 36): a target that closes at
each point of the exchange, acknowledges in 2 bytes, streams a dump that never ends or that passes the byte cap,
stalls, or is kvctl itself; strangers on the answers' listener. Each failure ends with the worker partial, the live
events held meanwhile applied, the answer's connection closed, and one loss in the health ledger by cause.

The hostile endpoint speaks the captured Dynamo 1.6.1 exchange (tests/server/test_zmq_recovery.py) up to the point
where it misbehaves; it waits for the test's go (`release`) first, so that the test holds a live event while the
query is out, as the plane does for a worker's events.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvctl.core.events import RouterEvent, Stored
from kvctl.core.events.publishers import Order
from kvctl.core.events.request_plane import RequestFrame, TwoPartReader, encode_two_part, parse_event_source
from kvctl.server.health import Health
from kvctl.server.plane.recovery import RecoveryClient
from kvctl.server.plane.recovery_answers import AnswerListener, RecoveryFailed
from kvctl.server.plane.zmq_sequences import default_advertise_host
from tests.nats_server import free_port
from tests.server.test_nats_plane import dump_blocks, expected_blocks
from tests.server.test_zmq_plane import Bench
from tests.server.test_zmq_recovery import CAPTURE, WORKER, put_source, read_request, row, source_record
from tests.support import eventually, eventually_async

PUBLISHER = CAPTURE["event_source"]["publisher_id"]
HELD = RouterEvent(WORKER[0], Stored(None, [999], [999]), 0, 7)  # a live event held while the query is out
_CAPTURED = TwoPartReader().feed(bytes.fromhex(CAPTURE["response_stream"]))
PROLOGUE = encode_two_part(*_CAPTURED[1])
DATA = encode_two_part(*_CAPTURED[2])  # the captured TreeDump's data message, not final: more may follow


def handshake(subject: str) -> bytes:
    return encode_two_part(json.dumps({"subject": subject, "stream_type": "response"}).encode(), b"")


Act = Callable[["Hostile", RequestFrame, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Hostile:
    """A worker's request-plane endpoint that reads the query, waits for `release`, then does `act`."""

    def __init__(self, act: Act, host: str = "127.0.0.1") -> None:
        self.act = act
        self.host = host
        self.requests: list[RequestFrame] = []
        self.release = asyncio.Event()
        self.closed = asyncio.Event()  # kvctl closed the connection this endpoint misbehaved on
        self.sent = 0  # answer bytes sent
        self.server: asyncio.Server | None = None
        self._answers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, self.host, 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await read_request(reader)
            self.requests.append(request)
            await self.release.wait()
            await self.act(self, request, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def answer(self, request: RequestFrame) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The connection back to the address the query named, its handshake sent."""
        host, port = request.reply["address"].rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
        self._answers.append(writer)
        await self.send(writer, handshake(request.reply["subject"]))
        return reader, writer

    async def send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        await writer.drain()
        self.sent += len(data)

    async def until_closed(self, reader: asyncio.StreamReader) -> None:
        """Until kvctl closes the connection (EOF or reset), then say so."""
        try:
            while await reader.read(1 << 16):
                pass
        except ConnectionError:
            pass
        self.closed.set()

    async def close(self) -> None:
        self.release.set()
        for writer in self._answers:
            writer.close()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def accepted(request: RequestFrame, writer: asyncio.StreamWriter) -> None:
    writer.write(b"\0\0\0\0")
    await writer.drain()


async def close_before_ack(h: Hostile, request: RequestFrame, r: asyncio.StreamReader,
                           w: asyncio.StreamWriter) -> None:
    pass  # the query's connection closes, nothing said


async def close_mid_ack(h: Hostile, request: RequestFrame, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    w.write(b"\0\0")  # 2 of the ack's 4 bytes
    await w.drain()


async def close_after_handshake(h: Hostile, request: RequestFrame, r: asyncio.StreamReader,
                                w: asyncio.StreamWriter) -> None:
    await accepted(request, w)
    _, back = await h.answer(request)
    back.close()


async def close_mid_dump(h: Hostile, request: RequestFrame, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    await accepted(request, w)
    _, back = await h.answer(request)
    await h.send(back, PROLOGUE + DATA[:len(DATA) // 2])
    back.close()


async def two_byte_ack_held_open(h: Hostile, request: RequestFrame, r: asyncio.StreamReader,
                                 w: asyncio.StreamWriter) -> None:
    w.write(b"\0\0")
    await w.drain()
    await h.until_closed(r)


async def never_ending_dump(h: Hostile, request: RequestFrame, r: asyncio.StreamReader,
                            w: asyncio.StreamWriter) -> None:
    """The captured dump's data message again and again, never final, as fast as kvctl reads it."""
    await accepted(request, w)
    back_reader, back = await h.answer(request)
    watch = asyncio.get_running_loop().create_task(h.until_closed(back_reader))
    try:
        await h.send(back, PROLOGUE)
        while not h.closed.is_set():
            await h.send(back, DATA * 16)
            await asyncio.sleep(0)
    except ConnectionError:
        await watch


async def stalled_after_handshake(h: Hostile, request: RequestFrame, r: asyncio.StreamReader,
                                  w: asyncio.StreamWriter) -> None:
    await accepted(request, w)
    back_reader, _ = await h.answer(request)
    await h.until_closed(back_reader)


@pytest.fixture
async def bench(tmp_path: Path) -> AsyncIterator[Bench]:
    b = Bench(tmp_path / "discovery")
    yield b
    await b.close()


@pytest.fixture
async def hostiles() -> AsyncIterator[list[Hostile]]:
    """The hostile endpoints a test made, closed after it."""
    made: list[Hostile] = []
    yield made
    for hostile in made:
        await hostile.close()


async def recover_from(bench: Bench, hostiles: list[Hostile], act: Act, **options: Any) -> Hostile:
    """A router whose worker's recovery target is a Hostile doing `act`, a live event held while it is asked;
    once the worker is partial."""
    hostile = Hostile(act)
    hostiles.append(hostile)
    put_source(bench.root, await hostile.start())
    plane = await bench.start(**options)
    await eventually_async(lambda: bool(hostile.requests), "the target asked")
    assert plane.ingest.recovery is not None
    assert plane.ingest.recovery.hold(HELD, Order.next, PUBLISHER, None)
    hostile.release.set()
    await eventually_async(lambda: row(bench).get("state") == "partial", "the worker marked partial")
    await bench.streams.writer("default").applied()
    return hostile


def losses(bench: Bench) -> dict[str, int]:
    assert bench.plane is not None
    return {cause: loss.count for (surface, cause), loss in bench.plane.fleet.health.losses.items()
            if surface == "recovery"}


def held_applied(bench: Bench) -> bool:
    assert bench.plane is not None
    return dump_blocks(bench.plane.fleet.models["default"].router.index.dump()) == expected_blocks([HELD])


@pytest.mark.parametrize(("act", "cause", "words"), [
    (close_before_ack, "closed_early", "after 0 of the 4 bytes of its acknowledgement"),
    (close_mid_ack, "closed_early", "after 2 of the 4 bytes of its acknowledgement"),
    (close_after_handshake, "closed_early", "closed its answer's connection after"),
    (close_mid_dump, "closed_early", "before the answer was whole"),
], ids=["before-ack", "mid-ack", "after-handshake", "mid-dump"])
async def test_a_target_that_closes_early_leaves_the_worker_partial_at_once(
        bench: Bench, hostiles: list[Hostile], act: Act, cause: str, words: str) -> None:
    """At once: the timeout (60 s) is far past the wait for the worker to be partial (10 s)."""
    await recover_from(bench, hostiles, act, recovery_timeout_s=60)
    assert words in row(bench)["reason"], row(bench)
    assert losses(bench) == {cause: 1} and held_applied(bench)
    assert bench.status()["recovery"]["workers"] == {"partial": 1}


async def test_a_two_byte_ack_held_open_times_out_and_is_closed(bench: Bench, hostiles: list[Hostile]) -> None:
    hostile = await recover_from(bench, hostiles, two_byte_ack_held_open, recovery_timeout_s=0.5)
    assert "no whole answer within --recovery-timeout (0.5 s)" in row(bench)["reason"]
    assert losses(bench) == {"timeout": 1} and held_applied(bench)
    await asyncio.wait_for(hostile.closed.wait(), 10)


async def test_a_dump_that_never_ends_is_cut_off_at_the_timeout(bench: Bench, hostiles: list[Hostile]) -> None:
    """Its connection is closed (the hostile's sends fail), not read on; the byte cap is far (1 GiB)."""
    hostile = await recover_from(bench, hostiles, never_ending_dump, recovery_timeout_s=0.5,
                                 recovery_max_bytes=1 << 30)
    assert losses(bench) == {"timeout": 1} and held_applied(bench)
    await asyncio.wait_for(hostile.closed.wait(), 10)
    assert hostile.sent > len(DATA)


async def test_a_dump_past_the_byte_cap_is_cut_off_there(bench: Bench, hostiles: list[Hostile]) -> None:
    hostile = await recover_from(bench, hostiles, never_ending_dump, recovery_timeout_s=60,
                                 recovery_max_bytes=1 << 20)
    assert "ran past --recovery-max-bytes (1,048,576 bytes)" in row(bench)["reason"]
    assert losses(bench) == {"too_large": 1} and held_applied(bench)
    await asyncio.wait_for(hostile.closed.wait(), 10)
    assert bench.status()["recovery"]["max_bytes"] == 1 << 20


async def test_a_target_that_is_the_routers_own_answer_listener_is_refused(bench: Bench) -> None:
    plane = await bench.start(recovery_timeout_s=60)
    put_source(bench.root, plane.recovery.client.listener.port)
    await eventually_async(lambda: row(bench).get("state") == "partial", "the worker marked partial")
    assert "this router's own answers' listener" in row(bench)["reason"] and losses(bench) == {"self": 1}


async def test_an_answer_that_stalls_is_cut_off_at_the_idle_timeout() -> None:
    hostile = Hostile(stalled_after_handshake)
    hostile.release.set()
    health = Health()
    client = RecoveryClient(AnswerListener(health, idle_s=0.2), timeout_s=60)
    target = parse_event_source(source_record(await hostile.start()))
    assert target is not None
    try:
        with pytest.raises(RecoveryFailed, match="stalled: no byte for 0.2 s") as caught:
            await client.query(target)
        assert caught.value.cause == "idle"
        await asyncio.wait_for(hostile.closed.wait(), 10)
    finally:
        await client.close()
        await hostile.close()


# ----- the answers' listener ----------------------------------------------------------------------------------

async def closed_by_kvctl(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), 10) == b""
    except ConnectionResetError:
        return True


async def test_the_listener_binds_the_listen_host_not_every_interface(bench: Bench) -> None:
    """`--listen 127.0.0.1` (ZmqOptions' default): the answers' listener is not reachable from another
    address of this host."""
    outside = default_advertise_host()
    if outside == "127.0.0.1":
        pytest.skip("this host has no address but loopback")
    plane = await bench.start()
    listener = plane.recovery.client.listener
    assert (listener.host, bench.status()["recovery"]["listener"]) == ("127.0.0.1", f"127.0.0.1:{listener.port}")
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection(outside, listener.port)


async def test_the_listener_binds_the_advertised_host_when_it_is_one_of_this_hosts() -> None:
    """`--advertise-host`: bound when it is an address of this host; else (NAT, a Kubernetes Service) the listen
    host is, and the advertised one is still what workers are told."""
    outside = default_advertise_host()
    if outside == "127.0.0.1":
        pytest.skip("this host has no address but loopback")
    for advertised, bound in ((outside, outside), ("192.0.2.1", "127.0.0.1")):  # TEST-NET-1: no host's address
        listener = AnswerListener(Health(), listen_host="127.0.0.1", advertise_host=advertised)
        await listener.start()
        try:
            assert (listener.host, listener.reply_host(outside, "10.0.0.9")) == (bound, advertised)
        finally:
            await listener.close()


async def test_a_worker_off_this_host_is_refused_at_once_by_a_loopback_listener() -> None:
    """It could never connect back to 127.0.0.1: said at once, not after the timeout."""
    outside = default_advertise_host()
    if outside == "127.0.0.1":
        pytest.skip("this host has no address but loopback")
    hostile = Hostile(stalled_after_handshake, host=outside)
    client = RecoveryClient(AnswerListener(Health(), listen_host="127.0.0.1"), timeout_s=60)
    target = parse_event_source(source_record(await hostile.start()).replace(b"127.0.0.1", outside.encode()))
    assert target is not None
    try:
        with pytest.raises(RecoveryFailed, match="give --advertise-host") as caught:
            await client.query(target)
        assert caught.value.cause == "loopback_listener" and hostile.requests == []
    finally:
        await client.close()
        await hostile.close()


async def test_a_connection_silent_past_the_handshake_timeout_is_closed_and_counted() -> None:
    health = Health()
    listener = AnswerListener(health, handshake_s=0.2)
    await listener.start()
    try:
        for first in (b"", handshake("x")[:10]):  # nothing; a handshake's first bytes only
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            writer.write(first)
            assert await closed_by_kvctl(reader)
            writer.close()
        assert health.losses[("recovery", "handshake_timeout")].count == 2
    finally:
        await listener.close()


async def test_connections_past_the_cap_are_refused_and_counted() -> None:
    """Two open (silent) connections fill a cap of 2: the third is closed at once; once one goes, another is
    taken. Connections are accepted in order, so the third is handled after the first two are counted."""
    health = Health()
    listener = AnswerListener(health, max_connections=2, handshake_s=60)
    await listener.start()
    held = [await asyncio.open_connection("127.0.0.1", listener.port) for _ in range(2)]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
        assert await closed_by_kvctl(reader)
        writer.close()
        assert health.losses[("recovery", "too_many_connections")].count == 1
        held[0][1].close()  # it goes: counted a stray when kvctl sees it close
        await eventually_async(lambda: listener.stray == 1, "the first connection gone")
        reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
        writer.write(handshake("nobody's"))
        assert await closed_by_kvctl(reader)  # taken, read, and dropped as naming no query
        writer.close()
        assert health.losses[("recovery", "too_many_connections")].count == 1 and listener.stray == 2
    finally:
        for _, w in held:
            w.close()
        await listener.close()


# ----- the router as a process --------------------------------------------------------------------------------

@contextmanager
def router(tmp_path: Path, port: int, *extra: str) -> Iterator[tuple[int, httpx.Client]]:
    """`kvctl serve --dynamo-discovery file:DIR` on 127.0.0.1:`port`: its pid and a client, once ready."""
    import subprocess

    cmd = [sys.executable, "-m", "kvctl", "serve", "--listen", f"127.0.0.1:{port}", "--state-dir",
           str(tmp_path / "state"), "--dynamo-discovery", f"file:{tmp_path / 'discovery'}", *extra]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
        try:
            url = proc.stdout.readline().strip()  # type: ignore[union-attr]
            with httpx.Client(base_url=url, timeout=5) as client:
                eventually(lambda: client.get("/readyz").status_code == 200, "the router ready", timeout=30)
                yield proc.pid, client
        finally:
            proc.kill()
            proc.wait()


def recovery_row(client: httpx.Client) -> dict[str, Any]:
    rows = {(w["worker_id"], w["dp_rank"]): w for w in client.get("/v1/status").json()["event_plane"]["workers"]}
    return rows.get(WORKER, {}).get("recovery") or {}


def recovery_losses(client: httpx.Client) -> dict[str, int]:
    return {loss["cause"]: loss["count"] for loss in client.get("/v1/status").json()["health"]["losses"]
            if loss["surface"] == "recovery"}


def test_a_target_at_the_routers_own_http_port_leaves_the_worker_partial(tmp_path: Path) -> None:
    """The router asks its own HTTP server, which answers `HTTP/1.1 400`: not Dynamo's request plane."""
    port = free_port()
    put_source(tmp_path / "discovery", port)
    with router(tmp_path, port, "--recovery-timeout", "60") as (_, client):
        eventually(lambda: recovery_row(client).get("state") == "partial", "the worker marked partial")
        assert "an HTTP server answered" in recovery_row(client)["reason"]
        assert recovery_losses(client) == {"bad_answer": 1}


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the router's RSS from /proc")
def test_the_routers_memory_stays_bounded_while_a_dump_never_ends(tmp_path: Path) -> None:
    """A never-ending dump streamed as fast as the router reads it, at the default byte cap (256 MiB) and a
    5 s timeout: the router's RSS stays within 32 MiB of what it was before (before issue 36's fix it grew by
    ~280 MB/s), the worker is partial within the timeout (and a second of slack), its connection closed."""
    bound = 32 << 20

    async def run() -> None:
        hostile = Hostile(never_ending_dump)
        put_source(tmp_path / "discovery", await hostile.start())
        try:
            await asyncio.to_thread(serve_and_watch, hostile, asyncio.get_running_loop())
        finally:
            await hostile.close()

    def serve_and_watch(hostile: Hostile, loop: asyncio.AbstractEventLoop) -> None:
        with router(tmp_path, free_port(), "--recovery-timeout", "5") as (pid, client):
            eventually(lambda: bool(hostile.requests), "the target asked")
            before = rss(pid)
            peak = before
            loop.call_soon_threadsafe(hostile.release.set)
            started = time.monotonic()
            while recovery_row(client).get("state") != "partial":
                peak = max(peak, rss(pid))
                assert peak - before < bound, f"RSS grew by {(peak - before) >> 20} MiB"
                assert time.monotonic() - started < 5 + 1, "not partial within the timeout"
                time.sleep(0.05)
            assert sum(recovery_losses(client).values()) == 1, recovery_losses(client)
            eventually(hostile.closed.is_set, "the dump's connection closed by the router")
            assert hostile.sent > bound  # it streamed past the bound: the router did not keep it

    asyncio.run(run())
