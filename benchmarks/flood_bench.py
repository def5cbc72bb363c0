"""Route latency while `kvctl serve` is flooded (issue 36): every input from a live fleet is untrusted, and none may
hold the router's loop. Per flood, a fresh router (`python -P -m kvctl serve`, so `PYTHONPATH` picks the code under
test), a prober sending a 64-token route back to back on one keep-alive connection, and the flood; the routes that
overlapped the flood give p50/p99/max, `/v1/status` the loop's longest stall of the last minute, and `/proc` the
router's peak RSS (its decode process included). Target: p99 under 50 ms during every flood.

Floods (one function each, registered in `FLOODS`: add one with `@flood("name")`):
  - publisher-ids: Dynamo's ZMQ plane (file discovery, one publisher's record), 100,000 load reports each under a
    new publisher id, at 10,000 a second;
  - nats-publisher-ids: the same on a NATS plane, 50,000 new ids at 10,000 a second;
  - huge-batches: an engine sending 3 messages of 100,000 stored events each (12 MB), one a second;
  - plane-huge-batches: the same on Dynamo's ZMQ plane: 3 kv-events messages of 100,000 RouterEvents (18 MB);
  - oversized-frames: an engine sending ten 256 MiB frames (each after the router subscribed again, or 3 s),
    then one ordinary batch, which must be applied;
  - header-flood: 16 connections (--connections) each streaming header lines that never end, for 5 s (each
    refused with 431 at --max-head-bytes and opened again);
  - discovery-records: 5,000 kv-events channel records written into the router's file-discovery store at once,
    each at a closed port, until the router has followed (or capped and counted) every one.

    python benchmarks/flood_bench.py [--floods publisher-ids,huge-batches] [--json]

Before/after: run it with `PYTHONPATH` at a checkout of each commit (its own benchmarks/ included, for the same
load). The machine's cores matter: flood, router and prober share them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import zmq
from _procs import Proc, rss_bytes
from scale_bench import Prober

from kvctl.core.events import RouterEvent, Stored
from kvctl.core.events.discovery import ChannelKey, encode_file_name
from kvctl.core.events.dynamo import EventEnvelope, encode_envelope, encode_router_event_batch
from kvctl.core.events.engine_encode import VLLM, BlockStored, encode_batch
from kvctl.core.events.plane import ActiveLoad, encode_active_load
from kvctl.core.events.zmq_wire import ZmqMessage, encode_zmq_message

TOKENS = list(range(64))
PROBED_WORKER = 999_999  # registered without an endpoint: the routes' candidate, untouched by any flood


@dataclass
class Router:
    proc: Proc
    url: str
    http: httpx.Client
    rss_peak: int = 0
    _sampling: threading.Event = field(default_factory=threading.Event)

    def status(self) -> dict[str, Any]:
        answer: dict[str, Any] = self.http.get("/v1/status").json()
        return answer

    def sample_rss(self) -> None:
        """Until the flood's window ends: the router's RSS (and its children's) every 10 ms, its peak kept."""
        while not self._sampling.wait(0.01):
            with contextlib.suppress(OSError):
                self.rss_peak = max(self.rss_peak, rss_bytes(self.proc.p.pid))


class Bench:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.ctx = zmq.Context()
        self._routers = 0

    @contextlib.contextmanager
    def router(self, *extra: str) -> Iterator[Router]:
        """A fresh `kvctl serve` (its own state dir), ready, with one endpoint-less worker for the routes."""
        self._routers += 1
        state_dir = self.workdir / f"state-{self._routers}"
        proc = Proc([sys.executable, "-P", "-m", "kvctl", "serve", "--listen", "127.0.0.1:0", "--state-dir",
                     str(state_dir), *extra])
        try:
            if not proc.first.wait(60):
                raise RuntimeError(f"kvctl serve did not start: {proc.tail()}")
            with httpx.Client(base_url=proc.first_line, timeout=60) as http:
                wait_until(lambda: _ready(http), 60, "kvctl serve ready", proc)
                http.post("/v1/workers", json={"worker_id": PROBED_WORKER}).raise_for_status()
                yield Router(proc, proc.first_line, http)
        finally:
            proc.stop()

    def engine(self) -> tuple[zmq.Socket[bytes], str]:
        """An engine's PUB (an XPUB: it hears its subscribers) on loopback, and its endpoint."""
        pub = self.ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 1_000_000)
        return pub, f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"

    def probed(self, router: Router, flood: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run `flood` while routes are probed; the routes that overlapped it, the loop's longest stall, the RSS."""
        prober = Prober(router.url, TOKENS)
        prober.start()
        sampler = threading.Thread(target=router.sample_rss, daemon=True)
        base = rss_bytes(router.proc.p.pid)
        sampler.start()
        time.sleep(0.5)  # the prober's connection warm
        t0 = time.perf_counter()
        try:
            extra = flood()
        finally:
            t1 = time.perf_counter()
            router._sampling.set()
            prober.stop()
        started = time.perf_counter()
        loop = router.status().get("loop") or {}
        status_ms = round((time.perf_counter() - started) * 1e3, 1)
        return {**prober.between(t0, t1), "flood_s": round(t1 - t0, 2), "status_ms": status_ms,
                "loop_longest_ms": round(loop.get("window_longest_s", 0.0) * 1e3, 1),
                "rss_growth_mb": round((max(router.rss_peak, base) - base) / 2**20, 1), **extra}


def wait_until(pred: Callable[[], bool], timeout: float, what: str, proc: Proc, every: float = 0.5) -> None:
    """Poll `pred` every `every` s: `/v1/status` of a router holding 4,096 publishers is itself work for its loop,
    which polling it every few ms would add to what the flood is measured by."""
    deadline = time.perf_counter() + timeout
    while not pred():
        if proc.p.poll() is not None:
            raise RuntimeError(f"{what}: the router exited ({proc.p.returncode}): {proc.tail()}")
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{what}: not reached in {timeout:.0f} s")
        time.sleep(every)


def _ready(http: httpx.Client) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return http.get("/readyz").status_code == 200
    return False


def subscribed(pub: zmq.Socket[bytes], timeout_s: float) -> bool:
    """Whether a subscription reached the XPUB within `timeout_s` (unsubscriptions skipped)."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if pub.poll(int(left * 1000) + 1) and pub.recv()[:1] == b"\x01":
            return True
    return False


def losses(router: Router) -> dict[str, int]:
    """The router's health ledger (absent before issue 36): losses by surface/cause."""
    ledger = router.status().get("health") or {}
    return {f"{x['surface']}/{x['cause']}": x["count"] for x in ledger.get("losses", [])}


FLOODS: dict[str, Callable[[Bench, argparse.Namespace], dict[str, Any]]] = {}


def flood(name: str) -> Callable[[Callable[[Bench, argparse.Namespace], dict[str, Any]]],
                                 Callable[[Bench, argparse.Namespace], dict[str, Any]]]:
    def register(fn: Callable[[Bench, argparse.Namespace], dict[str, Any]]
                 ) -> Callable[[Bench, argparse.Namespace], dict[str, Any]]:
        FLOODS[name] = fn
        return fn
    return register


@contextlib.contextmanager
def plane_publisher(bench: Bench, topic: str) -> Iterator[tuple[zmq.Socket[bytes], Router]]:
    """A publisher of `topic` on Dynamo's ZMQ plane (its record in a file-discovery dir, kept alive) and a router
    following the plane, subscribed to it."""
    pub, address = bench.engine()
    store = bench.workdir / f"discovery-{topic}"
    bucket = store / "v1" / "event_channels"
    bucket.mkdir(parents=True, exist_ok=True)
    key = ChannelKey("dynamo", "backend", "generate", topic, 0x51).key
    record = bucket / encode_file_name(key.removeprefix("v1/event_channels/"))
    record.write_text(json.dumps({
        "type": "EventChannel", "scope": {"kind": "endpoint", "endpoint": {
            "namespace": "dynamo", "component": "backend", "name": "generate"}},
        "topic": topic, "instance_id": 0x51, "transport": {"kind": "Zmq", "config": {"endpoint": address}}}))
    alive = threading.Event()

    def keep_alive() -> None:  # as its owner would: an untouched file record is dead after 10 s
        while not alive.wait(1.0):
            os.utime(record)

    threading.Thread(target=keep_alive, daemon=True).start()
    try:
        with bench.router("--dynamo-discovery", f"file:{store}") as router:
            if not subscribed(pub, 30):
                raise RuntimeError("the router never subscribed to the publisher")
            yield pub, router
    finally:
        alive.set()
        pub.close(0)


def plane_message(topic: str, publisher_id: int, sequence: int, payload: bytes) -> list[bytes]:
    envelope = encode_envelope(EventEnvelope(publisher_id, sequence, 0, topic, payload))
    return encode_zmq_message(ZmqMessage(topic, publisher_id, sequence, envelope))


def ingested(router: Router, topic: str) -> int:
    return int((router.status()["event_plane"].get("topics") or {}).get(topic, 0))


@flood("publisher-ids")
def publisher_ids(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """`args.ids` load reports on Dynamo's ZMQ plane, each from a publisher id never heard before."""
    report = encode_active_load(ActiveLoad(7, 0, 1, 16, 100))
    messages = [plane_message("kv_metrics", 10**6 + i, 0, report) for i in range(args.ids)]
    with plane_publisher(bench, "kv_metrics") as (pub, router):

        def send() -> dict[str, Any]:
            burst, start = max(1, args.rate // 100), time.perf_counter()
            for i in range(0, len(messages), burst):
                for frames in messages[i:i + burst]:
                    pub.send_multipart(frames)
                time.sleep(max(0.0, start + (i + burst) / args.rate - time.perf_counter()))
            sent_s = time.perf_counter() - start
            wait_until(lambda: ingested(router, "kv_metrics") >= len(messages), 120, "every report ingested",
                       router.proc)
            return {"sent_per_s": round(len(messages) / sent_s), "losses": losses(router)}

        return bench.probed(router, send)


@flood("nats-publisher-ids")
def nats_publisher_ids(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """`args.nats_ids` load reports on a NATS event plane, each from a publisher id never heard before."""
    import asyncio

    import nats

    from kvctl.core.events.plane import PlaneNames
    from tests.nats_server import NatsServer

    server = NatsServer(bench.workdir / "nats")
    subject = PlaneNames("dynamo", "backend", "generate").subject("kv_metrics")
    report = encode_active_load(ActiveLoad(7, 0, 1, 16, 100))
    payloads = [encode_envelope(EventEnvelope(10**6 + i, 0, 0, "kv_metrics", report)) for i in range(args.nats_ids)]

    async def publish() -> float:
        client = await nats.connect(server.url)
        start, burst = time.perf_counter(), max(1, args.rate // 100)
        for i in range(0, len(payloads), burst):
            for payload in payloads[i:i + burst]:
                await client.publish(subject, payload)
            await asyncio.sleep(max(0.0, start + (i + burst) / args.rate - time.perf_counter()))
        await client.flush()
        await client.close()
        return time.perf_counter() - start

    try:
        with bench.router("--nats", server.url, "--namespace", "dynamo") as router:

            def send() -> dict[str, Any]:
                sent_s = asyncio.run(publish())
                wait_until(lambda: ingested(router, "kv_metrics") >= len(payloads), 120, "every report ingested",
                           router.proc)
                return {"sent_per_s": round(len(payloads) / sent_s), "losses": losses(router)}

            return bench.probed(router, send)
    finally:
        server.stop()


@flood("plane-huge-batches")
def plane_huge_batches(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """`args.batches` kv-events messages of `args.events` events each on Dynamo's ZMQ plane, one a second."""
    messages = [plane_message("kv-events", 0x51, b, encode_router_event_batch(
        [RouterEvent(1, Stored(None, [b * args.events + i + 1], [i + 1]), 0, b * args.events + i)
         for i in range(args.events)])) for b in range(args.batches)]
    with plane_publisher(bench, "kv-events") as (pub, router):

        def send() -> dict[str, Any]:
            for frames in messages:
                pub.send_multipart(frames)
                time.sleep(1.0)
            wait_until(lambda: (router.status()["event_plane"].get("counts") or {}).get("events", 0)
                       >= args.events * len(messages), 300, "every event taken", router.proc)
            return {"payload_mb": round(len(messages[0][3]) / 2**20, 1)}

        return bench.probed(router, send)


@contextlib.contextmanager
def _following(bench: Bench, pub: zmq.Socket[bytes], endpoint: str) -> Iterator[Router]:
    """A router with the engine at `endpoint` registered as worker 1, once it has subscribed to `pub`."""
    with bench.router() as router:
        router.http.post("/v1/workers", json={"worker_id": 1, "endpoint": endpoint}).raise_for_status()
        if not subscribed(pub, 30):
            raise RuntimeError("the router never subscribed to the engine")
        yield router


@flood("huge-batches")
def huge_batches(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """`args.batches` engine messages of `args.events` stored events each, one a second."""
    pub, endpoint = bench.engine()
    payloads = [encode_batch(VLLM, 0.0, [BlockStored([b * args.events + i + 1], None, list(range(16)), 16)
                                         for i in range(args.events)]) for b in range(args.batches)]
    try:
        with _following(bench, pub, endpoint) as router:

            def send() -> dict[str, Any]:
                for seq, payload in enumerate(payloads):
                    pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
                    time.sleep(1.0)
                total = args.events * len(payloads)
                wait_until(lambda: _events(router) >= total, 300, "every batch applied", router.proc)
                return {"payload_mb": round(len(payloads[0]) / 2**20, 1), "events": total}

            return bench.probed(router, send)
    finally:
        pub.close(0)


def _events(router: Router) -> int:
    return sum(s["events"] for s in router.status()["streams"])


@flood("oversized-frames")
def oversized_frames(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """`args.frames` frames of `args.frame_mb` MiB on an engine's PUB, then an ordinary batch."""
    pub, endpoint = bench.engine()
    huge = b"\x93" + b"x" * ((args.frame_mb << 20) - 1)
    ordinary = encode_batch(VLLM, 0.0, [BlockStored([7], None, list(range(16)), 16)])
    try:
        with _following(bench, pub, endpoint) as router:

            def send() -> dict[str, Any]:
                resubscribed = 0
                for seq in range(args.frames):
                    pub.send_multipart([b"", seq.to_bytes(8, "big"), huge], copy=False)
                    resubscribed += subscribed(pub, 3.0)  # a router that drops the connection makes it again
                pub.send_multipart([b"", args.frames.to_bytes(8, "big"), ordinary])
                applied = True
                try:
                    wait_until(lambda: _events(router) >= 1, 60, "the ordinary batch applied", router.proc)
                except TimeoutError:
                    applied = False
                return {"rss_peak_mb": round(router.rss_peak / 2**20), "resubscribed": resubscribed,
                        "next_batch_applied": applied, "losses": losses(router)}

            return bench.probed(router, send)
    finally:
        pub.close(0)


@flood("header-flood")
def header_flood(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """`args.connections` clients streaming header lines for `args.seconds`: each connection the router cuts off
    (431) is opened again at once."""
    with bench.router() as router:
        host, port = router.url.removeprefix("http://").rsplit(":", 1)
        stop = threading.Event()
        sent = [0]

        def stream() -> None:
            line = b"x-flood: " + b"a" * 100 + b"\r\n"
            while not stop.is_set():
                with socket.create_connection((host, int(port))) as sock:
                    sock.sendall(b"POST /v1/route HTTP/1.1\r\nhost: x\r\n")
                    with contextlib.suppress(OSError):
                        while not stop.is_set():
                            sock.sendall(line * 64)
                            sent[0] += 64 * len(line)

        def send() -> dict[str, Any]:
            threads = [threading.Thread(target=stream, daemon=True) for _ in range(args.connections)]
            for thread in threads:
                thread.start()
            time.sleep(args.seconds)
            stop.set()
            for thread in threads:
                thread.join(10)
            return {"sent_mb": round(sent[0] / 2**20), "losses": losses(router)}

        return bench.probed(router, send)


@flood("discovery-records")
def discovery_records(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """`args.records` kv-events records at closed ports, written into a followed file store at once."""
    with plane_publisher(bench, "kv-events") as (_, router):
        bucket = bench.workdir / "discovery-kv-events" / "v1" / "event_channels"

        records = [bucket / encode_file_name(ChannelKey("dynamo", "backend", "generate", "kv-events", 0x1000 + i)
                                             .key.removeprefix("v1/event_channels/")) for i in range(args.records)]
        alive = threading.Event()

        def keep_alive() -> None:  # as their owners would: an untouched file record is dead after 10 s
            while not alive.wait(2.0):
                for record in records:
                    with contextlib.suppress(OSError):
                        os.utime(record)

        def send() -> dict[str, Any]:
            for i, record in enumerate(records):
                record.write_text(json.dumps({
                    "type": "EventChannel", "scope": {"kind": "endpoint", "endpoint": {
                        "namespace": "dynamo", "component": "backend", "name": "generate"}},
                    "topic": "kv-events", "instance_id": 0x1000 + i,
                    "transport": {"kind": "Zmq", "config": {"endpoint": f"tcp://127.0.0.1:{1 + i % 1000}"}}}))
            threading.Thread(target=keep_alive, daemon=True).start()

            def judged() -> bool:  # every record followed, or refused and counted (past --max-channels too)
                status = router.status()
                refused = sum(loss["count"] for loss in status["health"]["losses"] if loss["surface"] == "discovery")
                return len(status["event_plane"]["connections"]) + refused > args.records

            try:
                wait_until(judged, 120, "every record followed or counted", router.proc, every=1.0)
            finally:
                alive.set()
            status = router.status()["event_plane"]
            return {"followed": len(status["connections"]), "refused": status["discovery"]["stray"],
                    "losses": losses(router)}

        return bench.probed(router, send)


COLUMNS = ("routes", "p50_ms", "p99_ms", "max_ms", "loop_longest_ms", "rss_growth_mb", "flood_s")


def table(rows: dict[str, dict[str, Any]]) -> str:
    head = ["flood", *COLUMNS, "notes"]
    lines = [head]
    for name, row in rows.items():
        notes = ", ".join(f"{k}={v}" for k, v in row.items() if k not in COLUMNS)
        lines.append([name, *(str(row.get(c, "-")) for c in COLUMNS), notes])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(line, widths, strict=False)), line[-1]])
                     for line in lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floods", default=",".join(FLOODS), help=f"comma-separated, of: {', '.join(FLOODS)}")
    parser.add_argument("--ids", type=int, default=100_000, help="publisher-ids: new publisher ids")
    parser.add_argument("--rate", type=int, default=10_000, help="(nats-)publisher-ids: ids a second")
    parser.add_argument("--nats-ids", type=int, default=50_000, help="nats-publisher-ids: new publisher ids")
    parser.add_argument("--events", type=int, default=100_000, help="(plane-)huge-batches: events a message")
    parser.add_argument("--batches", type=int, default=3, help="(plane-)huge-batches: messages")
    parser.add_argument("--frames", type=int, default=10, help="oversized-frames: frames")
    parser.add_argument("--frame-mb", type=int, default=256, help="oversized-frames: MiB a frame")
    parser.add_argument("--connections", type=int, default=16, help="header-flood: clients")
    parser.add_argument("--seconds", type=float, default=5.0, help="header-flood: how long they stream")
    parser.add_argument("--records", type=int, default=5_000, help="discovery-records: records")
    parser.add_argument("--json", action="store_true", help="one JSON line per flood instead of the table")
    args = parser.parse_args()
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="flood-bench-") as tmp:
        bench = Bench(Path(tmp))
        for name in args.floods.split(","):
            rows[name] = FLOODS[name](bench, args)
            if args.json:
                print(json.dumps({"flood": name, **rows[name]}), flush=True)
        bench.ctx.term()
    if not args.json:
        print(table(rows))


if __name__ == "__main__":
    main()
