"""Events/s sustained through NATS Core and JetStream into the index of `kvctl serve --nats`, and apply lag p99.

Per mode (`core`, `jetstream`), a fresh nats-server (JetStream, temp store) and a fresh
`kvctl serve --nats URL --namespace bench --router-id 1 [--jetstream]`; nothing is registered, workers
become known on their first event. The workload is W publishers (worker ids 1..W) of BlockStored
RouterEvents of B blocks each (Dynamo's publisher batches up to 128 blocks per event), event ids from 1 per
worker, in a global round-robin order. Each worker stores, once, each of 8 shared prefixes it uses (same
hashes on every worker), then B fresh blocks per event: a new conversation under a prefix or the next
turn under its previous event's last block (up to 4 turns). Local hashes are xxh3 of random token blocks
(`local_block_hashes`), block hashes chain from the parent as Dynamo's sequence hashes do, so every event
adds exactly B (worker, block) pairs. Everything is encoded before timing, exactly as Dynamo's workers
publish it: NATS Core, the msgpack EventEnvelope around the msgpack RouterEvent on
`namespace.bench.component.backend.kv-events`; JetStream, the RouterEvent JSON on `{stream}.kv-events`.

  - throughput: all N events from one nats-py connection as fast as it goes (Core: `publish`, then a
    flush; JetStream: `js.publish` in windows of 256 acks in flight, a window acked before the next
    goes, so each publisher's order holds), then `GET /v1/status` every 20 ms until the index holds the
    expected pairs. events/s and blocks/s run from the first publish to the poll that saw the last one
    applied (so up to 20 ms late); `publish_s` is the publishing alone. NATS Core has no backpressure: a
    router that falls behind is a slow consumer (nats-py drops what overflows its pending limits, the
    server may cut the connection, kvctl's writer queue drops when full). Then the count never arrives:
    after 10 s without progress the row says `complete: false` and shows what arrived and what was lost;
  - sustained rate and apply lag: events published at a fixed rate (`--rate`, default half the measured
    events/s of that mode) for `--lag-seconds`, with a probe every 50 ms: a 1-block store at the root from
    a dedicated probe worker, of a token block never used before. The main thread polls
    `POST /v1/route {"local_hashes": [probe], "explain": true}` every 1 ms over one keep-alive client until
    the probe worker's `overlap_blocks` is 1: publish -> visible in the index, p50/p99/max. `drain_s` is
    how long after the last publish the index took to hold everything (about 0 when the rate is
    sustained).

    python benchmarks/nats_bench.py [--events 200000] [--publishers 16] [--blocks 16] [--modes core,jetstream]
                                    [--rate EVENTS_PER_S] [--lag-seconds 10] [--quick]

Prints one JSON line per mode. Caveats: the publisher (this process), nats-server and the router share the
machine's cores (`cpus`; `cpu_s` and `lag_cpu_s` tell who used them in each phase), and the 1 ms probe
polling is itself load on the router's event loop; the lag includes one HTTP round trip. Quote medians of
several runs.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import queue
import random
import sys
import tempfile
import threading
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import nats
from _procs import Proc, cpu_seconds, rss_bytes  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvctl.core.events import RouterEvent, Stored  # noqa: E402
from kvctl.core.events.dynamo import (  # noqa: E402
    EventEnvelope,
    encode_envelope,
    encode_router_event_json,
    encode_router_event_msgpack,
)
from kvctl.core.events.plane import PlaneNames  # noqa: E402
from kvctl.core.hashing import local_block_hashes, sequence_hashes  # noqa: E402
from kvctl.nats.barrier import barrier  # noqa: E402
from tests.nats_server import NatsServer  # noqa: E402

BLOCK = 16
PREFIXES, TURNS = 8, 4
NAMESPACE, COMPONENT = "bench", "backend"
PROBE_WORKER = 1_000_000
JS_WINDOW = 256
POLL_S = 0.02  # status polling while waiting for the index
STALL_S = 10.0  # no progress for this long: what is missing is lost
PROBE_EVERY_S = 0.05
PROBE_POLL_S = 0.001
PROBE_GIVE_UP_S = 30.0
TICK_S = 0.001  # the paced publisher's tick


# ----- workload ------------------------------------------------------------------------------------------

def _tokens(rng: random.Random, blocks: int) -> array:
    return array("I", rng.randbytes(4 * BLOCK * blocks))


def stored(parent: int | None, local: list[int]) -> Stored:
    """A store of these local hashes under `parent`, its block hashes chained from it as Dynamo's are."""
    chained = sequence_hashes(local) if parent is None else sequence_hashes([parent, *local])[1:]
    return Stored(parent, chained, local)


class Workload:
    """The seeded events of W workers, taken in round-robin order; two instances of one seed are equal."""

    def __init__(self, workers: int, blocks: int, seed: int = 7) -> None:
        self.rng = random.Random(seed)
        self.workers, self.blocks = workers, blocks
        self.prefixes = [stored(None, self._locals()) for _ in range(PREFIXES)]
        self.next_id = [1] * workers
        self.stored_prefix: list[set[int]] = [set() for _ in range(workers)]
        self.tail: list[tuple[int | None, int]] = [(None, 0)] * workers  # (last block of the last event, turns)
        self.turn = 0  # whose event is next

    def _locals(self) -> list[int]:
        return local_block_hashes(_tokens(self.rng, self.blocks), BLOCK)

    def _data(self, w: int) -> Stored:
        last, turns = self.tail[w]
        if last is not None and turns < TURNS and self.rng.random() < 0.5:
            data, turns = stored(last, self._locals()), turns + 1  # the conversation's next turn
        else:
            p = self.rng.randrange(PREFIXES)
            if p not in self.stored_prefix[w]:
                self.stored_prefix[w].add(p)
                data, turns = self.prefixes[p], 0
            else:
                data, turns = stored(self.prefixes[p].block_hashes[-1], self._locals()), 1
        self.tail[w] = (data.block_hashes[-1], turns)
        return data

    def take(self, n: int) -> list[RouterEvent]:
        out = []
        for _ in range(n):
            w = self.turn
            self.turn = (w + 1) % self.workers
            out.append(RouterEvent(w + 1, self._data(w), 0, self.next_id[w]))
            self.next_id[w] += 1
        return out


class Probes:
    """1-block stores at the root by PROBE_WORKER, each of a token block no one else stores."""

    def __init__(self, seed: int = 11) -> None:
        self.rng = random.Random(seed)
        self.next_id = 1

    def take(self) -> tuple[int, RouterEvent]:
        (local,) = local_block_hashes(_tokens(self.rng, 1), BLOCK)
        ev = RouterEvent(PROBE_WORKER, Stored(None, sequence_hashes([local]), [local]), 0, self.next_id)
        self.next_id += 1
        return local, ev


def encoder(jetstream: bool) -> Callable[[RouterEvent], bytes]:
    """The bytes a Dynamo worker publishes for one event: JetStream JSON, or the Core msgpack envelope."""
    if jetstream:
        return encode_router_event_json
    now_ms = int(time.time() * 1000)

    def core(ev: RouterEvent) -> bytes:
        return encode_envelope(EventEnvelope(ev.worker_id, ev.event_id, now_ms, "kv-events",
                                             encode_router_event_msgpack(ev)))
    return core


# ----- publisher -----------------------------------------------------------------------------------------

class Publisher:
    """One nats-py connection on its own event-loop thread, so the main thread can poll HTTP meanwhile."""

    def __init__(self, url: str, jetstream: bool) -> None:
        names = PlaneNames(NAMESPACE, COMPONENT)
        self.subject = names.stream_subject if jetstream else names.kv_events
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.nc: Any = self.call(nats.connect(url, name="nats-bench"))
        self.js = self.nc.jetstream() if jetstream else None

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Any) -> Any:
        return self.submit(coro).result()

    async def send(self, payloads: list[bytes]) -> None:
        """Every payload in order; returns once NATS has them all (Core: a flush; JetStream: every ack)."""
        if self.js is None:
            for p in payloads:
                await self.nc.publish(self.subject, p)
            await barrier(self.nc)
            return
        for start in range(0, len(payloads), JS_WINDOW):
            await asyncio.gather(*(self.js.publish(self.subject, p) for p in payloads[start:start + JS_WINDOW]))

    async def paced(self, payloads: list[bytes], rate: float, probes: list[tuple[int, bytes]],
                    sent_probes: queue.SimpleQueue[tuple[int, float] | None]) -> tuple[int, float]:
        """`payloads` at `rate` events/s with a probe every PROBE_EVERY_S; each probe's (hash, publish time)
        goes to `sent_probes`, then None. Returns (events sent, seconds taken)."""
        t0 = time.perf_counter()
        sent = k = 0
        try:
            while sent < len(payloads):
                now = time.perf_counter()
                due = min(len(payloads), int((now - t0) * rate) + 1)
                batch, sent = payloads[sent:due], due
                if k < len(probes) and now >= t0 + k * PROBE_EVERY_S:
                    local, probe = probes[k]
                    k += 1
                    batch.append(probe)
                    sent_probes.put((local, time.perf_counter()))
                if self.js is None:
                    for p in batch:
                        await self.nc.publish(self.subject, p)
                else:
                    await asyncio.gather(*(self.js.publish(self.subject, p) for p in batch))
                await asyncio.sleep(TICK_S)
            await barrier(self.nc)
            return sent, time.perf_counter() - t0
        finally:
            sent_probes.put(None)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.call(self.nc.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


# ----- processes -----------------------------------------------------------------------------------------


class Router:
    """`kvctl serve` following the event plane, and the HTTP clients that watch it."""

    def __init__(self, nats_url: str, state_dir: str, jetstream: bool) -> None:
        argv = [sys.executable, "-m", "kvctl", "serve", "--listen", "127.0.0.1:0", "--state-dir", state_dir,
                "--no-restore", "--snapshot-interval", "86400", "--nats", nats_url, "--namespace", NAMESPACE,
                "--router-id", "1"]
        self.proc = Proc(argv + (["--jetstream"] if jetstream else []))
        if not self.proc.first.wait(60):
            raise RuntimeError(f"kvctl serve printed no URL: {self.proc.tail()}")
        self.http = httpx.Client(base_url=self.proc.first_line.strip(), timeout=30)
        self.probe_http = httpx.Client(base_url=self.proc.first_line.strip(), timeout=30)
        deadline = time.perf_counter() + 60
        while not self.status()["event_plane"]["ready"]:
            if time.perf_counter() > deadline or self.proc.p.poll() is not None:
                raise RuntimeError(f"event plane not ready: {self.proc.tail()}")
            time.sleep(POLL_S)

    def status(self) -> dict[str, Any]:
        r = self.http.get("/v1/status")
        r.raise_for_status()
        return r.json()

    def visible(self, local: int) -> bool:
        """Whether the probe worker holds this root block: its overlap_blocks in an explained route is 1."""
        r = self.probe_http.post("/v1/route", json={"local_hashes": [local], "explain": True})
        if r.status_code != 200:  # no candidates yet
            return False
        return any(c["worker_id"] == PROBE_WORKER and c["overlap_blocks"] == 1 for c in r.json()["candidates"])

    def stop(self) -> None:
        self.http.close()
        self.probe_http.close()
        self.proc.stop()


def pairs_held(status: dict[str, Any]) -> int:
    model = status["models"].get("default")
    return sum(model["workers"].values()) if model else 0


def wait_pairs(router: Router, expected: int) -> tuple[float, dict[str, Any]]:
    """Poll until the index holds `expected` pairs, or nothing moved for STALL_S. Returns (the time of the
    last poll that saw progress, the last status)."""
    last_seen, last_change = None, time.perf_counter()
    while True:
        status = router.status()
        now = time.perf_counter()
        plane = status["event_plane"]["counts"]
        seen = (pairs_held(status), plane.get("messages", 0))
        if seen != last_seen:
            last_seen, last_change = seen, now
        if seen[0] >= expected or now - last_change > STALL_S:
            return last_change, status
        if router.proc.p.poll() is not None:
            raise RuntimeError(f"kvctl serve exited ({router.proc.p.returncode}): {router.proc.tail()}")
        time.sleep(POLL_S)


def index_outcomes(router: Router) -> dict[str, int]:
    """`kvctl_kv_events_applied_total` by (event type, outcome): what the index did with what it was given."""
    families = text_string_to_metric_families(router.http.get("/metrics").text)
    return {f"{s.labels['event_type']}/{s.labels['status']}": int(s.value) for f in families
            if f.name == "kvctl_kv_events_applied" for s in f.samples if s.name.endswith("_total")}


def what_arrived(router: Router, status: dict[str, Any], expected_pairs: int) -> dict[str, Any]:
    """Where the missing events went: NATS-side gaps, the writer queue's drops, the index's rejections."""
    plane = status["event_plane"]
    return {"pairs_held": pairs_held(status), "pairs_expected": expected_pairs, "counts": plane["counts"],
            "decode_errors": plane["decode_errors"], "queues": status["queues"], "index": index_outcomes(router),
            "state": plane["state"], "reconnects": plane["reconnects"], "last_error": plane["last_error"]}


# ----- one mode ------------------------------------------------------------------------------------------

def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def cpu_times(router: Router, nats_pid: int) -> dict[str, float]:
    return {"router": cpu_seconds(router.proc.p.pid), "nats_server": cpu_seconds(nats_pid),
            "bench": time.process_time()}


def cpu_since(before: dict[str, float], router: Router, nats_pid: int) -> dict[str, float]:
    """CPU seconds each process used since `before`: who had the machine's cores."""
    return {k: round(v - before[k], 2) for k, v in cpu_times(router, nats_pid).items()}


def throughput(router: Router, pub: Publisher, nats_pid: int, payloads: list[bytes], blocks: int,
               base_pairs: int) -> dict[str, Any]:
    expected = base_pairs + len(payloads) * blocks
    cpu0 = cpu_times(router, nats_pid)
    t0 = time.perf_counter()
    pub.call(pub.send(payloads))
    t_pub = time.perf_counter()
    t1, status = wait_pairs(router, expected)
    applied = (pairs_held(status) - base_pairs) // blocks
    out: dict[str, Any] = {
        "publish_s": round(t_pub - t0, 3), "applied_s": round(t1 - t0, 3),
        "events_per_s": round(applied / (t1 - t0)), "blocks_per_s": round(applied * blocks / (t1 - t0)),
        "complete": pairs_held(status) == expected,
        "cpu_s": cpu_since(cpu0, router, nats_pid),
    }
    if not out["complete"]:
        out["lost"] = what_arrived(router, status, expected)
    return out


def probe_lags(router: Router, sent_probes: queue.SimpleQueue[tuple[int, float] | None]) -> tuple[list[float], int]:
    """Publish -> visible of each probe, in seconds, polled every PROBE_POLL_S; and how many never showed."""
    lags, missing = [], 0
    while (item := sent_probes.get()) is not None:
        local, t_pub = item
        while not router.visible(local):
            if time.perf_counter() - t_pub > PROBE_GIVE_UP_S:
                missing += 1
                break
            time.sleep(PROBE_POLL_S)
        else:
            lags.append(time.perf_counter() - t_pub)
    return lags, missing


def sustained(router: Router, pub: Publisher, nats_pid: int, wl: Workload, probes: Probes,
              encode: Callable[[RouterEvent], bytes], rate: float, seconds: float) -> dict[str, Any]:
    payloads = [encode(ev) for ev in wl.take(int(rate * seconds))]
    probe_payloads = [(local, encode(ev)) for local, ev in (probes.take() for _ in range(int(seconds / PROBE_EVERY_S)))]
    base = pairs_held(router.status())
    sent_probes: queue.SimpleQueue[tuple[int, float] | None] = queue.SimpleQueue()
    cpu0 = cpu_times(router, nats_pid)
    fut = pub.submit(pub.paced(payloads, rate, probe_payloads, sent_probes))
    lags, missing = probe_lags(router, sent_probes)
    sent, elapsed = fut.result()
    cpu = cpu_since(cpu0, router, nats_pid)
    t_end = time.perf_counter()
    expected = base + sent * wl.blocks + len(lags) + missing
    t1, status = wait_pairs(router, expected)
    out: dict[str, Any] = {
        "target_rate": round(rate), "sustained_rate": round(sent / elapsed),
        "lag_ms": {"p50": round(percentile(lags, 0.5) * 1e3, 2), "p99": round(percentile(lags, 0.99) * 1e3, 2),
                   "max": round(max(lags) * 1e3, 2)} if lags else None,
        "probes": len(lags), "probes_missing": missing, "drain_s": round(max(0.0, t1 - t_end), 3),
        "lag_cpu_s": cpu,
    }
    if pairs_held(status) != expected:
        out["lost_while_paced"] = what_arrived(router, status, expected)
    return out


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    jetstream = mode == "jetstream"
    encode = encoder(jetstream)
    wl, probes = Workload(args.publishers, args.blocks), Probes()
    payloads = [encode(ev) for ev in wl.take(args.events)]
    row: dict[str, Any] = {"mode": mode, "publishers": args.publishers, "events": args.events,
                           "blocks_per_event": args.blocks,
                           "payload_bytes_mean": round(sum(map(len, payloads)) / len(payloads))}
    with tempfile.TemporaryDirectory(prefix="nats_bench-") as tmp:
        nats_server = NatsServer(Path(tmp, "nats"))
        router: Router | None = None
        pub: Publisher | None = None
        try:
            router = Router(nats_server.url, str(Path(tmp, "state")), jetstream)
            pub = Publisher(nats_server.url, jetstream)
            local, warm = probes.take()  # warms the whole path, from publish to route
            pub.call(pub.send([encode(warm)]))
            deadline = time.perf_counter() + 30
            while not router.visible(local):
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"{mode}: the warm-up probe never showed: {router.status()['event_plane']}")
                time.sleep(POLL_S)
            assert nats_server.proc is not None
            row.update(throughput(router, pub, nats_server.proc.pid, payloads, args.blocks, base_pairs=1))
            del payloads
            rate = args.rate or row["events_per_s"] / 2
            row.update(sustained(router, pub, nats_server.proc.pid, wl, probes, encode, rate, args.lag_seconds))
            status = router.status()
            row["router_counts"] = status["event_plane"]["counts"]
            row["rss_mib"] = round(rss_bytes(router.proc.p.pid) / 2**20, 1)
            row["cpus"] = os.cpu_count()
            return row
        finally:
            if pub is not None:
                pub.close()
            if router is not None:
                router.stop()
            nats_server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=200_000, help="events in the throughput phase (default 200k)")
    ap.add_argument("--publishers", type=int, default=16, help="worker ids 1..W publishing (default 16)")
    ap.add_argument("--blocks", type=int, default=16, help="blocks per BlockStored event (default 16)")
    ap.add_argument("--modes", default="core,jetstream", help="comma-separated: core, jetstream (default both)")
    ap.add_argument("--rate", type=float, default=None,
                    help="events/s offered in the lag phase (default: half the measured events/s of the mode)")
    ap.add_argument("--lag-seconds", type=float, default=10.0, help="length of the lag phase (default 10)")
    ap.add_argument("--quick", action="store_true", help="20k events")
    args = ap.parse_args()
    if args.quick:
        args.events = 20_000
    for mode in args.modes.split(","):
        if mode not in ("core", "jetstream"):
            ap.error(f"unknown mode {mode!r}")
        print(json.dumps(run_mode(mode, args)), flush=True)


if __name__ == "__main__":
    main()
