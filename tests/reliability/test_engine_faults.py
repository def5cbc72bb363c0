"""Engine-side faults against real ZMQ sockets, real processes and the router's real index (issue 11).

Each test compares what the router indexes with what the engine holds and prints one line,
`FAULT <name> lost=<n> ...`, with the number of blocks (and batches) the router lost:

- engine-restart: a `kvctl mock` engine SIGKILLed mid-stream and started again on the same ports,
  feeding a real `kvctl serve`: its worker is cleared and rebuilt exactly, the other worker untouched.
  The new engine's first batches leave before the router has reconnected; they are a gap from seq 0,
  replayed (engine-restart-no-replay: without a replay endpoint, counted lost). Before that was
  fixed in zmq_source they were skipped silently, with the stream claiming to be whole.
- hwm-overflow: a flood past the PUB's and the SUB's high-water marks makes ZMQ drop batches; the
  stream sees the seq gaps and replays them: nothing lost.
- replay-dies: the engine's replay socket answers part of a replay and then goes away; the router
  counts the failed replay and exactly the batches it could not get, keeps serving, and once the
  socket is back the next gap replays whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio

from kvctl.core.events import Cleared
from kvctl.core.events.engine_encode import VLLM, BlockRemoved, BlockStored, encode_batch
from kvctl.core.hashing import local_block_hashes
from kvctl.mock.hashing import BlockHasher, HashStyle
from kvctl.process_cpu import process_tree
from kvctl.server.ingest.streams import ModelWriter
from kvctl.server.ingest.zmq_source import EngineStream
from kvctl.server.state import Fleet
from tests.nats_server import stop_process
from tests.support import eventually, eventually_async
from tests.support.served import on_both_route_paths

BLOCK = 16
Block = tuple[int, int]  # (engine block hash, tokens hash): what the router's dump shows of a block
END = (2**64 - 1).to_bytes(8, "big")


# -- processes ------------------------------------------------------------------------------------


def free_base(count: int = 3) -> int:
    """A port P with P..P+count-1 all free on loopback (below the ephemeral range, which the kernel hands out)."""
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(20_000, 32_000 - count)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


@contextmanager
def frozen(pid: int) -> Iterator[None]:
    """SIGSTOP pid and its descendants for the block, then SIGCONT them."""
    pids = process_tree(pid)
    for p in pids:
        os.kill(p, signal.SIGSTOP)
    try:
        yield
    finally:
        for p in pids:
            os.kill(p, signal.SIGCONT)


@contextmanager
def router(state_dir: Path, *args: str) -> Iterator[tuple[subprocess.Popen[str], httpx.Client, Path]]:
    """A real `kvctl serve` on a free port, once its restore is done (its URL comes first, and /v1/tree answers
    503 until then); its log goes to a file (a pipe nobody reads would stall it)."""
    log = state_dir.parent / f"{state_dir.name}-serve.log"
    cmd = [sys.executable, "-m", "kvctl", "serve", "--listen", "127.0.0.1:0", "--state-dir", str(state_dir),
           "--log-level", "info", *args]
    with log.open("a") as err, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                                env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
        try:
            url = proc.stdout.readline().strip()  # type: ignore[union-attr]
            assert url.startswith("http://127.0.0.1:"), f"kvctl serve did not start: {log.read_text()}"
            with httpx.Client(base_url=url, timeout=60) as client:  # a busy machine is slow, not broken
                eventually(lambda: client.get("/readyz").status_code == 200, "the restore", timeout=120)
                yield proc, client, log
        finally:
            stop_process(proc)


class MockEngine:
    """`kvctl mock --engines 1` as its own process, on fixed ports (HTTP P, PUB P+1, replay P+2)."""

    def __init__(self, base_port: int, log: Path) -> None:
        self.base_port = base_port
        self.log = log
        self.proc: subprocess.Popen[str] | None = None
        self.http: httpx.Client | None = None
        self.start()

    def start(self) -> None:
        self.close_http()
        self.close_pipe()
        cmd = [sys.executable, "-m", "kvctl", "mock", "--engines", "1", "--base-port", str(self.base_port),
               "-o", "json"]
        with self.log.open("a") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert line, f"kvctl mock did not start: {self.log.read_text()}"
        info = json.loads(line)[0]
        self.endpoint, self.replay_endpoint = info["endpoint"], info["replay_endpoint"]
        assert self.endpoint == f"tcp://127.0.0.1:{self.base_port + 1}"
        self.http = httpx.Client(base_url=info["url"], timeout=5)

    def generate(self, tokens: list[int]) -> None:
        """One request, read to its end: its blocks are cached and their batch is on the wire."""
        assert self.http is not None
        reply = self.http.post("/v1/generate", json={"token_ids": tokens, "max_tokens": 1})
        reply.raise_for_status()
        assert reply.text.count("\n") == 2, reply.text

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def close_pipe(self) -> None:
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def close_http(self) -> None:
        if self.http is not None:
            self.http.close()
            self.http = None

    def stop(self) -> None:
        self.close_http()
        if self.proc is not None:
            stop_process(self.proc)
            self.close_pipe()


def prompt(n: int, blocks: int = 4) -> list[int]:
    """A prompt of `blocks` full blocks that shares nothing with any other n."""
    return [n * 10_000 + t for t in range(blocks * BLOCK)]


_VLLM_HASHER = BlockHasher(HashStyle.vllm)


def mock_blocks(tokens: list[int]) -> set[Block]:
    """What a `kvctl mock` (vLLM format) engine caches for a prompt, as the router's dump shows it."""
    chain = _VLLM_HASHER.chain(tokens, BLOCK)
    return {(h, local) for (h, _), local in zip(chain, local_block_hashes(tokens, BLOCK), strict=True)}


def dump_blocks(client: httpx.Client, worker: int) -> set[Block]:
    dump = client.get("/v1/tree", params={"worker": str(worker)}).json()
    return {(b["block_hash"], b["tokens_hash"]) for ev in dump for b in ev["event"]["data"]["stored"]["blocks"]}


def stream(client: httpx.Client, worker: int) -> dict[str, Any]:
    return next(s for s in client.get("/v1/status").json()["streams"] if s["worker"]["worker_id"] == worker)


def follow(client: httpx.Client, engine: MockEngine, worker: int, first: int) -> list[list[int]]:
    """Send fresh prompts until the router's stream has taken one; returns the prompts it holds.

    The router does not ask for what an engine sent before it connected (by design), so the prompts
    of batches before the first one it saw are the engine's alone: left out of what is compared.
    One prompt of fresh blocks is one batch, so probe i is seq i.
    """
    probes: list[list[int]] = []
    deadline = time.monotonic() + 15
    while True:
        probes.append(prompt(first + len(probes)))
        engine.generate(probes[-1])
        try:
            eventually(lambda: stream(client, worker), "a first batch", until=lambda s: s["batches_applied"] > 0,
                       timeout=0.3)
            break
        except AssertionError:
            assert time.monotonic() < deadline, "the router never received a batch"
    eventually(lambda: stream(client, worker), "the last probe", until=lambda s: s["last_seq"] == len(probes) - 1)
    s = stream(client, worker)
    return probes[s["last_seq"] - s["batches_applied"] + 1:]


class Flow(threading.Thread):
    """Requests to one engine, one after another, until stopped or the engine goes away."""

    def __init__(self, engine: MockEngine, first: int) -> None:
        super().__init__(daemon=True)
        self.engine, self.next = engine, first
        self.done: list[list[int]] = []
        self.halt = threading.Event()
        self.failed: Exception | None = None

    def run(self) -> None:
        while not self.halt.is_set():
            tokens = prompt(self.next)
            self.next += 1
            try:
                self.engine.generate(tokens)
            except httpx.HTTPError as exc:  # the engine was killed under us
                self.failed = exc
                return
            self.done.append(tokens)

    def wait_for(self, count: int) -> None:
        eventually(lambda: len(self.done) >= count or self.failed is not None, f"{count} requests")
        assert self.failed is None, self.failed

    def finish(self) -> None:
        self.halt.set()
        self.join(10)


def union(prompts: list[list[int]]) -> set[Block]:
    return set().union(*(mock_blocks(p) for p in prompts))


# -- a: engine process killed and restarted --------------------------------------------------------


def test_engine_sigkilled_and_restarted_on_the_same_ports(tmp_path: Path) -> None:
    state = tmp_path / "state"
    one, two = MockEngine(free_base(), tmp_path / "engine1.log"), MockEngine(free_base(), tmp_path / "engine2.log")
    flows: list[Flow] = []
    try:
        with router(state, "--worker", f"1={one.endpoint},replay={one.replay_endpoint}",
                    "--worker", f"2={two.endpoint},replay={two.replay_endpoint}") as (serve, client, log):
            follow(client, one, 1, first=1000)
            held_two = follow(client, two, 2, first=2000)
            # Both engines busy; engine 1 dies mid-stream, with requests in flight.
            flows = [Flow(one, 1100), Flow(two, 2100)]
            for flow in flows:
                flow.start()
            flows[0].wait_for(15)
            flows[1].wait_for(5)
            before = stream(client, 1)
            one.kill()
            flows[0].join(10)
            assert flows[0].failed is not None  # its requests were cut off: it really died mid-flow
            # The new engine (same ports, cold cache, seq from 0) serves its first requests before the
            # router's SUB has reconnected: the router and its decode process (which holds the SUB where
            # there are two cores) are held still here, so that those batches surely go nowhere.
            with frozen(serve.pid):
                one.start()
                early = [prompt(n) for n in range(1500, 1503)]
                for tokens in early:
                    one.generate(tokens)
            # Then old prompts again and new ones; the router, reconnected, sees the seq go back.
            again = early + flows[0].done[:3] + [prompt(n) for n in range(1503, 1506)]
            for tokens in again[len(early):]:
                one.generate(tokens)
            flows[1].wait_for(len(flows[1].done) + 5)  # engine 2 kept going all along
            flows[1].finish()
            held_one, held_two = union(again), union(held_two + flows[1].done)

            def settled() -> bool:
                return dump_blocks(client, 1) == held_one and dump_blocks(client, 2) == held_two

            try:
                eventually(settled, "the router to hold what both engines hold")
            finally:
                got_one, got_two = dump_blocks(client, 1), dump_blocks(client, 2)
                lost_one, lost_two = len(held_one - got_one), len(held_two - got_two)
                stale = len(got_one - held_one)  # blocks of the dead engine still indexed
                s1, s2 = stream(client, 1), stream(client, 2)
                print(f"FAULT engine-restart lost={lost_one + lost_two} (restarted worker: lost {lost_one} of "
                      f"{len(held_one)} blocks, {stale} stale; other worker: lost {lost_two} of {len(held_two)}; "
                      f"router had {before['last_seq'] + 1} batches of the dead engine)")
            # One restart; the new engine's first batches, sent before the router heard it, were a gap
            # from seq 0 that the replay filled.
            assert (s1["restarts"], s1["gaps"], s1["replays_ok"], s1["lost_batches"], s1["gapped"]) == (
                1, 1, 1, 0, False), s1
            assert (s2["restarts"], s2["gaps"], s2["lost_batches"], s2["gapped"]) == (0, 0, 0, False), s2
            assert "engine restart" in log.read_text()
    finally:
        for flow in flows:
            flow.finish()
        one.stop()
        two.stop()


# -- b, c: an engine's sockets in this process, with the knobs the faults need ---------------------


class Engine:
    """What an engine's KV-event side runs (vLLM's ZmqEventPublisher): a PUB (as XPUB, which hears when the
    router has subscribed) for `[topic, seq, payload]`, a replay buffer, and a ROUTER answering `[b"", start]`
    with `[b"", topic, seq, payload]` per buffered batch from `start`, then the end marker.

    `sndhwm` / `sndbuf` bound what the PUB queues for a slow subscriber: past that, ZMQ drops, as a real PUB
    does. `answer_at_most` makes the replay socket stop answering after that many replies (it "dies");
    `kill_replay` closes it and `revive_replay` binds a new one on the same port, with the same buffer.
    """

    def __init__(self, ctx: zmq.asyncio.Context, *, sndhwm: int = 1000, sndbuf: int = -1) -> None:
        self.ctx = ctx
        self.pub = ctx.socket(zmq.XPUB)
        for option, value in ((zmq.LINGER, 0), (zmq.SNDHWM, sndhwm), (zmq.SNDBUF, sndbuf)):
            self.pub.setsockopt(option, value)  # before bind: a bound socket's connections take them from there
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self._send = zmq.Socket.shadow(self.pub.underlying)  # synchronous: a flood never yields to the loop
        self.buffer: list[bytes] = []  # the payload of seq i
        self.requests: list[int] = []
        self.replies = 0
        self.answer_at_most: int | None = None
        self.replay_port = 0
        self.router = self._bind_router()
        self.task: asyncio.Task[None] = asyncio.ensure_future(self._serve(self.router))

    def _bind_router(self) -> zmq.asyncio.Socket:
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.SNDHWM, 0)  # a whole replay fits, however long
        if self.replay_port:
            router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        else:
            self.replay_port = router.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://127.0.0.1:{self.replay_port}"
        return router

    def publish(self, payload: bytes, *, live: bool = True) -> int:
        seq = len(self.buffer)
        self.buffer.append(payload)
        if live:  # a PUB never blocks: at its high-water mark the message is dropped, silently
            self._send.send_multipart([b"", seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        return seq

    async def subscribed(self) -> None:
        message = await asyncio.wait_for(self.pub.recv(), 10)
        assert message[:1] == b"\x01", message

    async def _serve(self, router: zmq.asyncio.Socket) -> None:
        while True:
            identity, _, start = await router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.requests.append(first)
            for seq in range(first, len(self.buffer)):
                if self.answer_at_most is not None and self.replies >= self.answer_at_most:
                    return  # dead mid-replay: not another word
                await router.send_multipart([identity, b"", b"", seq.to_bytes(8, "big"), self.buffer[seq]])
                self.replies += 1
            await router.send_multipart([identity, b"", b"", END, b""])

    async def kill_replay(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.router.close(linger=0)

    async def revive_replay(self) -> None:
        deadline = time.monotonic() + 5
        while True:
            try:
                self.router = self._bind_router()
                break
            except zmq.ZMQError:  # the closed socket's port is released by ZMQ's I/O thread, shortly
                assert time.monotonic() < deadline, "the replay port never came free"
                await asyncio.sleep(0.01)
        self.answer_at_most = None
        self.task = asyncio.ensure_future(self._serve(self.router))

    async def close(self) -> None:
        await self.kill_replay()
        self.pub.close(linger=0)


class Holdings:
    """The engine's cache as its batches leave it: batch n stores a chain of its own, maybe removes another."""

    def __init__(self, blocks: int = 8) -> None:
        self.blocks_per_batch = blocks
        self.chains: dict[int, set[Block]] = {}

    def batch(self, n: int, *, remove: int | None = None) -> bytes:
        b = self.blocks_per_batch
        tokens = [n * 1009 + t for t in range(b * BLOCK)]  # n * 1009 > b * BLOCK: no two batches share a block
        hashes = [(n << 16) + i + 1 for i in range(b)]
        events: list[BlockStored | BlockRemoved] = [
            BlockStored(hashes, None, tokens, BLOCK, extra=VLLM.plain_stored_extra(b))]
        self.chains[n] = set(zip(hashes, local_block_hashes(tokens, BLOCK), strict=True))
        if remove is not None:
            events.append(BlockRemoved([h for h, _ in self.chains.pop(remove)], extra=VLLM.plain_removed_extra()))
        return encode_batch(VLLM, time.time(), events)

    def held(self) -> set[Block]:
        return set().union(*self.chains.values())


def index_blocks(fleet: Fleet) -> set[Block]:
    return {(h, t) for ev in fleet.models["default"].router.index.dump()
            for h, t in zip(ev.data.block_hashes, ev.data.tokens_hashes, strict=True)}  # type: ignore[union-attr]


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def test_hwm_overflow_drops_are_seen_as_gaps_and_replayed(ctx: zmq.asyncio.Context) -> None:
    """A router far slower than its engine: its SUB (RCVHWM 4) and the engine's PUB (SNDHWM 4, a 4 KiB
    socket buffer) overflow and ZMQ drops batches, which only the seqs reveal. The router's writer and
    index are the real ones; the floods run without yielding, so the stream cannot read meanwhile."""
    engine = Engine(ctx, sndhwm=4, sndbuf=4096)
    fleet = Fleet(block_size=BLOCK)
    writer = ModelWriter(fleet, "default")
    stream = EngineStream((1, 0), engine.endpoint, engine.replay_endpoint, block_size=BLOCK, sink=writer.put,
                          on_restart=lambda key: writer.put(key, [Cleared()]), context=ctx, rcvhwm=4, downstream=writer)
    task = asyncio.ensure_future(stream.run())
    cache = Holdings()
    try:
        await engine.subscribed()
        engine.publish(cache.batch(0))
        await eventually_async(lambda: stream.stats.batches_applied == 1, "the first batch")
        n = 1
        for _ in range(3):  # three floods, each cut short by ZMQ; some batches also remove an older chain
            for _ in range(400):
                engine.publish(cache.batch(n, remove=n - 3 if n % 4 == 0 else None))
                n += 1
            await asyncio.sleep(0.05)  # let the stream read some (it may be mid-replay: that is the point)
        # The tail of the last flood was dropped too, and only a later batch shows it: trickle until one lands.
        last = -1
        while stream.stats.last_seq != last or stream.stats.replaying:
            if not stream.stats.replaying:
                last = engine.publish(cache.batch(n))
                n += 1
            await asyncio.sleep(0.1)
            assert n < 1300, stream.stats
        await writer.applied()
        stats = stream.stats
        held, indexed = cache.held(), index_blocks(fleet)
        dropped = len(engine.buffer) - stats.messages  # live messages ZMQ never delivered
        print(f"FAULT hwm-overflow lost={len(held - indexed)} ({dropped} of {len(engine.buffer)} live batches "
              f"dropped by ZMQ, {stats.gaps} gaps, {stats.replays_ok} replays; lost_batches={stats.lost_batches}, "
              f"{len(held)} blocks held)")
        assert dropped > 0 and stats.gaps > 0 and stats.replays_ok > 0  # the fault really happened
        assert (stats.replays_failed, stats.lost_batches, stats.gapped, stats.restarts) == (0, 0, False, 0), stats
        assert stats.batches_applied == len(engine.buffer)
        assert indexed == held  # stores and removes applied in the engine's order: the same cache
    finally:
        await _stop_in_process(stream, task, writer, engine)


@contextlib.asynccontextmanager
async def async_router(state_dir: Path, *args: str
                       ) -> AsyncIterator[tuple[asyncio.subprocess.Process, httpx.AsyncClient, Path]]:
    """`router()` for tests whose engine runs in this event loop (a blocking wait would stall its replies)."""
    log = state_dir.parent / f"{state_dir.name}-serve.log"
    with log.open("a") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvctl", "serve", "--listen", "127.0.0.1:0", "--state-dir", str(state_dir),
            "--log-level", "info", *args, stdout=asyncio.subprocess.PIPE, stderr=err,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = (await proc.stdout.readline()).decode().strip()  # type: ignore[union-attr]
        assert url.startswith("http://127.0.0.1:"), f"kvctl serve did not start: {log.read_text()}"
        async with httpx.AsyncClient(base_url=url, timeout=5) as client:
            yield proc, client, log
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


@on_both_route_paths
async def test_replay_endpoint_dying_mid_replay(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    """A gap of 10 batches; the engine's replay socket sends 4 of them and dies. The router gives the
    replay up (its 2 s timeout), counts exactly the 6 it could not get as lost, and keeps serving. The
    engine's replay socket comes back on the same port; the next gap is replayed whole."""
    engine = Engine(ctx)
    cache = Holdings()
    async with async_router(tmp_path / "state", "--worker", f"1={engine.endpoint},replay={engine.replay_endpoint}"
                            ) as (proc, client, log):
        async def s1() -> dict[str, Any]:
            return next(s for s in (await client.get("/v1/status")).json()["streams"] if s["worker"]["worker_id"] == 1)

        async def router_blocks() -> set[Block]:
            dump = (await client.get("/v1/tree")).json()
            return {(b["block_hash"], b["tokens_hash"]) for ev in dump for b in ev["event"]["data"]["stored"]["blocks"]}

        try:
            await engine.subscribed()
            for n in range(5):
                engine.publish(cache.batch(n))
            await eventually_async(s1, "the first batches", until=lambda s: s["last_seq"] == 4)
            for n in range(5, 15):  # seqs 5..14 never go out live
                engine.publish(cache.batch(n), live=False)
            engine.answer_at_most = 4  # the replay will carry 5..8, then nothing more
            engine.publish(cache.batch(15))  # the gap shows
            await eventually_async(s1, "the four replayed batches",
                                   until=lambda s: s["last_seq"] == 8 and s["replaying"])
            await engine.kill_replay()  # mid-replay: 9..14 are never sent
            s = await eventually_async(s1, "the replay to be given up",
                                       until=lambda s: s["replays_failed"] == 1, timeout=10)
            lost_first = {b for n in range(9, 15) for b in cache.chains[n]}
            assert (s["gaps"], s["replays_ok"], s["lost_batches"], s["gapped"], s["last_seq"]) == (1, 0, 6, True, 15), s
            assert await router_blocks() == cache.held() - lost_first  # 5..8 and 15 are in, 9..14 are not
            # Still serving: it routes on what it has, and takes more events.
            hit = (await client.post("/v1/route", json={"token_ids": [5 * 1009 + t for t in range(8 * BLOCK)]})).json()
            assert (hit["worker_id"], hit["overlap_blocks"]) == (1, 8), hit
            assert proc.returncode is None and (await client.get("/healthz")).json()["status"] == "ok"

            await engine.revive_replay()  # the engine's replay socket is back, same port, same buffer
            engine.publish(cache.batch(16))
            engine.publish(cache.batch(17), live=False)
            engine.publish(cache.batch(18, remove=16))
            s = await eventually_async(s1, "the second replay",
                                       until=lambda s: s["last_seq"] == 18 and not s["replaying"])
            assert engine.requests == [5, 17]
            held, indexed = cache.held(), await router_blocks()
            lost = held - indexed
            print(f"FAULT replay-dies lost={s['lost_batches']} batches ({len(lost)} blocks: seqs 9-14, the part of "
                  f"a 10-batch gap the dying replay never sent; replays ok={s['replays_ok']} "
                  f"failed={s['replays_failed']})")
            assert (s["gaps"], s["replays_ok"], s["replays_failed"], s["lost_batches"]) == (2, 1, 1, 6), s
            assert lost == lost_first and indexed == held - lost_first  # nothing else missing, nothing stale
            assert "replay timed out" in log.read_text()
        finally:
            await engine.close()


async def test_restart_first_heard_past_seq_0_without_replay_counts_what_went_by(ctx: zmq.asyncio.Context) -> None:
    """The engine-restart case above without a replay endpoint: the new engine's first two batches went
    out before the router heard it. They cannot be fetched, so they are counted lost and the stream is
    gapped (before the fix they were skipped silently, the stream claiming to be whole)."""
    engine = Engine(ctx)
    fleet = Fleet(block_size=BLOCK)
    writer = ModelWriter(fleet, "default")
    stream = EngineStream((1, 0), engine.endpoint, None, block_size=BLOCK, sink=writer.put,
                          on_restart=lambda key: writer.put(key, [Cleared()]), context=ctx)
    task = asyncio.ensure_future(stream.run())
    old, new = Holdings(), Holdings()
    try:
        await engine.subscribed()
        for n in range(6):
            engine.publish(old.batch(n))
        await eventually_async(lambda: stream.stats.last_seq == 5, "the old engine's batches")
        engine.buffer.clear()  # restarted: seq from 0, nothing kept
        for n in range(100, 102):
            engine.publish(new.batch(n), live=False)  # before the router's SUB was back
        for n in range(102, 105):
            engine.publish(new.batch(n))
        await eventually_async(lambda: stream.stats.last_seq == 4, "the new engine's batches")
        await writer.applied()
        stats, indexed = stream.stats, index_blocks(fleet)
        missing = new.held() - indexed
        print(f"FAULT engine-restart-no-replay lost={stats.lost_batches} batches ({len(missing)} blocks: the "
              f"new engine's seqs 0-1, sent before the router heard it)")
        assert (stats.restarts, stats.lost_batches, stats.gapped) == (1, 2, True), stats
        assert missing == new.chains[100] | new.chains[101] and indexed == new.held() - missing  # old ones cleared
    finally:
        await _stop_in_process(stream, task, writer, engine)


async def _stop_in_process(stream: Any, task: asyncio.Task[None], writer: Any, engine: Any) -> None:
    """Close an in-process stream (it must not have died), its writer and its engine."""
    await stream.aclose()
    task.result()
    writer.task.cancel()
    await asyncio.gather(writer.task, return_exceptions=True)
    await engine.close()
