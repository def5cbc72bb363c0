"""End-to-end `kvctl serve` benchmark over real ZMQ: ingest rate, route latency and memory, vs Dynamo's indexer.

W synthetic engines (ZMQ PUB sockets on 127.0.0.1) publish vLLM-format KV events (the map-encoded wire of
vLLM >= 0.24, checked key by key against the vllm-0.33 fixtures before anything runs). Each engine's
seeded workload: 8 shared system prompts of 64 blocks plus a unique 64-block suffix per request, one
BlockStored per request (the first request of a worker for a prompt stores from the root, later ones only
the suffix under the prompt's last block), until `--pairs` (worker, block) pairs are held; then one
BlockRemoved per request, newest request first, its blocks leaf first.

Per system, in turn, on the same workload (fresh sockets, seq from 0), the other one idle:
  - ingest: stored and removed blocks/s, from the first timed publish until the server holds exactly the
    expected pairs (kvctl: `GET /v1/tree/stats`, polled every 20 ms). Dynamo's indexer exposes no cheap
    count, so every engine ends each phase with a 1-block sentinel store (removal); the phase ends when
    `/query` of the sentinel sees all W engines (none), and a `/dump` afterwards checks the exact count.
    The sentinel is published to kvctl too, so both get the same messages;
  - RSS per (worker, block) pair: server VmRSS after the stores minus before, over pairs;
  - CPU seconds the server (every process and thread of it) spent on each ingest phase, polls included:
    where publishers, server and client share few cores, a rate also says how much of them the server got;
  - kvctl only: its event loop's lag over each phase (`kvctl_event_loop_lag_seconds`, a probe every 10 ms):
    probes over 5 and 25 ms late, and the bucket that holds the latest. A stall there is what a route or
    health check arriving during a burst would wait.
Then, both systems up and re-populated, route latency of 2048-token requests (a system prompt + 1024 fresh
tokens), client-observed over one keep-alive httpx.Client per system (kvctl `POST /v1/route`, Dynamo
`POST /query`), each query sent to both in turn: measured one system after the other, the machine's drift
between the two phases moved the ratio by more than the difference it measures (0.62 to 1.26 over five runs
on a 2-core VM, where alternating requests gives 1.00 to 1.05).

    python benchmarks/serve_bench.py [--workers 16,128] [--pairs 100000] [--quick] [--no-oracle]

Prints one JSON line per worker count. The machine's core count matters: publishers, server and client
share it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import xxhash
import zmq
from _procs import Proc, cpu_seconds, rss_bytes  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("KVCTL_FIXTURES", ROOT / "tests" / "fixtures")) / "vllm-0.33"
BLOCK = 16
PROMPTS, PROMPT_BLOCKS, SUFFIX_BLOCKS = 8, 64, 64
POLL_S = 0.02
WAIT_S = 300.0
MODEL = "bench"

ENC = msgspec.msgpack.Encoder()


# ----- wire format ---------------------------------------------------------------------------------------

def stored_event(block_hashes: list[int], parent: int | None, token_ids: list[int]) -> dict[str, Any]:
    """A vLLM BlockStored event map, keys in vLLM's struct order (see the self-check)."""
    return {"type": "BlockStored", "block_hashes": block_hashes, "parent_block_hash": parent,
            "token_ids": token_ids, "block_size": BLOCK, "lora_id": None, "medium": "GPU", "lora_name": None,
            "extra_keys": [None] * len(block_hashes), "group_idx": 0}


def removed_event(block_hashes: list[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": block_hashes, "medium": "GPU", "group_idx": 0}


def payload(events: list[dict[str, Any]], ts: float, dp_rank: int = 0) -> bytes:
    return ENC.encode([ts, events, dp_rank])


def self_check() -> None:
    """Our encoding of fixtures a (stored) and c (removed) must decode to the fixture's wire, keys in order.

    Not byte for byte: vLLM's msgspec Structs write a map16 header where a dict gets a fixmap; decoders
    see the same map either way.
    """
    manifest = json.loads((FIXTURES / "manifest.json").read_text())
    cases = {m["file"]: m for m in manifest["messages"]}
    for name in ("a_block_stored_4x16.msgpack", "c_block_removed.msgpack"):
        case = cases[name]
        exp = case["decoded_expectation"]
        events = []
        for ev in exp["events"]:
            if ev["type"] == "BlockStored":
                events.append(stored_event(ev["block_hashes"], ev["parent_block_hash"], ev["token_ids"]))
            else:
                events.append(removed_event(ev["block_hashes"]))
        ours = payload(events, exp["ts"], exp["dp_rank"])
        wire = case["wire_untyped"]
        mine = msgspec.msgpack.decode(ours)
        assert [list(e) for e in mine[1]] == [list(e) for e in wire[1]], f"{name}: event keys differ from the wire"
        assert mine == wire, f"{name}: decoded payload differs from wire_untyped"
        assert mine == msgspec.msgpack.decode((FIXTURES / name).read_bytes()), f"{name}: differs from the fixture"
        assert case["topic"] == "" and case["seq"] >= 0


# ----- workload ------------------------------------------------------------------------------------------

def _tokens(rng: random.Random, blocks: int) -> list[int]:
    return [t % 32_000 for t in array("H", rng.randbytes(2 * BLOCK * blocks))]


def chain(parent: int | None, tokens: list[int]) -> list[int]:
    out, prev = [], parent or 0
    for i in range(0, len(tokens), BLOCK):
        prev = xxhash.xxh3_64_intdigest(prev.to_bytes(8, "little") + array("I", tokens[i:i + BLOCK]).tobytes())
        out.append(prev)
    return out


class Workload:
    """Pre-encoded payloads per engine; `order` is the global publish order as (engine, index)."""

    def __init__(self, workers: int, pairs: int, seed: int = 7) -> None:
        rng = random.Random(seed)
        self.workers = workers
        self.prompts = [_tokens(rng, PROMPT_BLOCKS) for _ in range(PROMPTS)]
        prompt_hashes = [chain(None, p) for p in self.prompts]
        ts = 1.7e9
        self.stores: list[list[bytes]] = [[] for _ in range(workers)]
        removes: list[list[bytes]] = [[] for _ in range(workers)]
        self.order: list[tuple[int, int]] = []
        held: set[tuple[int, int]] = set()
        self.pairs = 0
        i = 0
        while self.pairs < pairs:
            w, p = i % workers, rng.randrange(PROMPTS)
            i += 1
            suffix = _tokens(rng, SUFFIX_BLOCKS)
            suffix_hashes = chain(prompt_hashes[p][-1], suffix)
            if (w, p) in held:
                ev = stored_event(suffix_hashes, prompt_hashes[p][-1], suffix)
                blocks = suffix_hashes
            else:
                held.add((w, p))
                blocks = prompt_hashes[p] + suffix_hashes
                ev = stored_event(blocks, None, self.prompts[p] + suffix)
            self.pairs += len(blocks)
            self.order.append((w, len(self.stores[w])))
            self.stores[w].append(payload([ev], ts))
            removes[w].append(payload([removed_event(blocks[::-1])], ts))
        self.removes = [r[::-1] for r in removes]  # newest request first
        self.remove_order = [(w, len(self.stores[w]) - 1 - k) for w, k in reversed(self.order)]
        # warm-up (left in place: the baseline) and the phase sentinel, each one block shared by all engines
        self.warm_tokens = _tokens(rng, 1)
        warm_hash = chain(None, self.warm_tokens)
        self.warm = payload([stored_event(warm_hash, None, self.warm_tokens)], ts)
        self.sentinel_tokens = _tokens(rng, 1)
        sentinel_hash = chain(None, self.sentinel_tokens)
        self.sentinel_store = payload([stored_event(sentinel_hash, None, self.sentinel_tokens)], ts)
        self.sentinel_remove = payload([removed_event(sentinel_hash)], ts)
        self.queries = [self.prompts[k % PROMPTS] + _tokens(rng, 1024 // BLOCK) for k in range(400)]


class Publishers:
    def __init__(self, workers: int) -> None:
        self.ctx = zmq.Context()
        self.socks = []
        self.ports = []
        for _ in range(workers):
            s = self.ctx.socket(zmq.PUB)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.LINGER, 0)
            self.ports.append(s.bind_to_random_port("tcp://127.0.0.1"))
            self.socks.append(s)
        self.seq = [0] * workers

    def send(self, w: int, body: bytes) -> None:
        self.socks[w].send_multipart([b"", self.seq[w].to_bytes(8, "big"), body], copy=False)
        self.seq[w] += 1

    def endpoints(self) -> list[str]:
        return [f"tcp://127.0.0.1:{p}" for p in self.ports]

    def close(self) -> None:
        for s in self.socks:
            s.close(0)
        self.ctx.term()


# ----- processes -----------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]




def wait_until(pred: Callable[[], bool], timeout: float, what: str, proc: Proc | None = None) -> float:
    deadline = time.perf_counter() + timeout
    while True:
        if pred():
            return time.perf_counter()
        if proc is not None and proc.p.poll() is not None:
            raise RuntimeError(f"{what}: server exited ({proc.p.returncode}): {proc.tail()}")
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{what}: not reached in {timeout:.0f} s")
        time.sleep(POLL_S)


# ----- the two systems -----------------------------------------------------------------------------------

class Kvctl:
    name = "kvctl"

    def __init__(self, endpoints: list[str], state_dir: str) -> None:
        argv = [sys.executable, "-m", "kvctl", "serve", "--listen", "127.0.0.1:0", "--state-dir", state_dir,
                "--no-restore", "--snapshot-interval", "86400"]
        for w, ep in enumerate(endpoints):
            argv += ["--worker", f"{w + 1}:0={ep}"]
        self.proc = Proc(argv)
        if not self.proc.first.wait(60):
            raise RuntimeError(f"kvctl serve printed no URL: {self.proc.tail()}")
        self.http = httpx.Client(base_url=self.proc.first_line.strip(), timeout=30)
        self.workers = len(endpoints)

    def ready(self) -> bool:
        streams = self.http.get("/v1/status").json()["streams"]
        return len(streams) == self.workers and all(s["messages"] > 0 for s in streams)

    def not_ready(self) -> str:
        streams = self.http.get("/v1/status").json()["streams"]
        bad = [{k: v for k, v in st.items() if k in ("worker", "endpoint", "messages", "state", "error")}
               for st in streams if st["messages"] == 0]
        return f"({len(streams)} streams, silent: {json.dumps(bad)[:600]})"

    def count(self) -> int:
        model = self.http.get("/v1/tree/stats").json()["models"].get("default")
        return sum(model["workers"].values()) if model else 0

    def route(self, tokens: list[int]) -> int:
        r = self.http.post("/v1/route", json={"token_ids": tokens})
        r.raise_for_status()
        return r.json()["overlap_blocks"]

    def ping(self) -> None:
        self.http.get("/healthz").raise_for_status()

    def loop_lag(self) -> dict[float, float]:
        """kvctl_event_loop_lag_seconds so far: upper bound (s) -> probes at most that late (+inf: all)."""
        for family in text_string_to_metric_families(self.http.get("/metrics").text):
            if family.name == "kvctl_event_loop_lag_seconds":
                return {float(s.labels["le"]): s.value for s in family.samples if s.name.endswith("_bucket")}
        raise RuntimeError("kvctl serve exports no kvctl_event_loop_lag_seconds")

    def stop(self) -> None:
        self.http.close()
        self.proc.stop()


def lag_between(before: dict[float, float], after: dict[float, float]) -> dict[str, Any]:
    """The loop-lag probes of a phase: how many, how many came over 5 and 25 ms late, and the bucket bound
    that holds the latest of them."""
    probes = {le: after[le] - before.get(le, 0.0) for le in after}
    total = probes[math.inf]
    worst = min(le for le, n in probes.items() if n == total)
    return {"probes": int(total), "over_5ms": int(total - probes[0.005]), "over_25ms": int(total - probes[0.025]),
            "worst_within_ms": None if worst == math.inf else worst * 1e3}


class Dynamo:
    name = "dynamo"

    def __init__(self, endpoints: list[str], threads: int | None) -> None:
        port = free_port()
        argv = [sys.executable, "-m", "dynamo.indexer", "--port", str(port), "--block-size", str(BLOCK)]
        if threads:
            argv += ["--threads", str(threads)]
        self.proc = Proc(argv)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        self.workers = len(endpoints)
        wait_until(self._up, 60, "dynamo.indexer HTTP", self.proc)
        for w, ep in enumerate(endpoints):
            r = self.http.post("/register", json={"instance_id": w + 1, "endpoint": ep, "model_name": MODEL,
                                                  "block_size": BLOCK})
            r.raise_for_status()
        listed = self.http.get("/workers").json()
        if len(listed) != self.workers:
            raise RuntimeError(f"/workers lists {len(listed)} instances, registered {self.workers}")

    def _up(self) -> bool:
        try:
            return self.http.get("/workers").status_code == 200
        except httpx.TransportError:
            return False

    def holders(self, tokens: list[int]) -> int:
        r = self.http.post("/query", json={"token_ids": tokens, "model_name": MODEL})
        if r.status_code != 200:  # no indexer for the model yet
            return 0
        return sum(1 for dp in r.json().get("scores", {}).values() if any(v > 0 for v in dp.values()))

    def count(self) -> int:
        total = 0
        for model in self.http.get("/dump").json().values():
            for item in model["events"]:
                stored = item["event"]["data"].get("stored") if isinstance(item["event"]["data"], dict) else None
                if stored:
                    total += len(stored["blocks"])
        return total

    def route(self, tokens: list[int]) -> int:
        r = self.http.post("/query", json={"token_ids": tokens, "model_name": MODEL})
        r.raise_for_status()
        scores = [v for dp in r.json()["scores"].values() for v in dp.values()]
        return max(scores, default=0)

    def ping(self) -> None:
        self.http.get("/health").raise_for_status()

    def stop(self) -> None:
        self.http.close()
        self.proc.stop()


# ----- one run -------------------------------------------------------------------------------------------

def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Running:
    """A system under test with its engines, kept up after its ingest phases for the paired route phase."""

    def __init__(self, kind: str, wl: Workload, threads: int | None) -> None:
        self.pubs = Publishers(wl.workers)
        self.tmp = tempfile.TemporaryDirectory(prefix="serve_bench-")
        self.server: Kvctl | Dynamo | None = None
        try:
            self.server = Kvctl(self.pubs.endpoints(), self.tmp.name) if kind == "kvctl" else Dynamo(
                self.pubs.endpoints(), threads)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.pubs.close()
        self.tmp.cleanup()


def ingest(kind: str, running: Running, wl: Workload) -> dict[str, Any]:
    """Warm up, then the timed store and removal phases; the stores are re-published (untimed) at the end."""
    pubs, server = running.pubs, running.server
    assert server is not None
    proc, W = server.proc, wl.workers

    # slow joiner: repeat the warm-up store until every subscription has delivered
    if isinstance(server, Kvctl):
        ready = server.ready
    else:
        def ready() -> bool:
            return server.holders(wl.warm_tokens) == W
    deadline = time.perf_counter() + 60
    while not ready():
        if time.perf_counter() > deadline or proc.p.poll() is not None:
            detail = server.not_ready() if isinstance(server, Kvctl) else ""
            raise RuntimeError(f"{kind}: subscriptions not ready {detail}: {proc.tail()}")
        for w in range(W):
            pubs.send(w, wl.warm)
        time.sleep(0.05)
    baseline = W
    wait_until(lambda: server.count() == baseline, 30, f"{kind}: warm-up baseline", proc)
    time.sleep(0.2)
    rss0 = rss_bytes(proc.p.pid)

    def publish(order: list[tuple[int, int]], msgs: list[list[bytes]], sentinel: bytes) -> None:
        for w, k in order:
            pubs.send(w, msgs[w][k])
        for w in range(W):
            pubs.send(w, sentinel)

    if isinstance(server, Kvctl):
        stored_done = lambda: server.count() == baseline + wl.pairs + W  # noqa: E731
        removed_done = lambda: server.count() == baseline  # noqa: E731
    else:
        stored_done = lambda: server.holders(wl.sentinel_tokens) == W  # noqa: E731
        removed_done = lambda: server.holders(wl.sentinel_tokens) == 0  # noqa: E731

    out: dict[str, Any] = {}
    lag = server.loop_lag if isinstance(server, Kvctl) else None
    lag0 = lag() if lag else {}
    cpu0 = cpu_seconds(proc.p.pid)
    t0 = time.perf_counter()
    publish(wl.order, wl.stores, wl.sentinel_store)
    t_pub = time.perf_counter()
    t1 = wait_until(stored_done, WAIT_S, f"{kind}: stores", proc)
    rss1 = rss_bytes(proc.p.pid)
    out["store_blocks_per_s"] = round(wl.pairs / (t1 - t0))
    out["store_s"] = round(t1 - t0, 3)
    out["store_cpu_s"] = round(cpu_seconds(proc.p.pid) - cpu0, 3)
    out["publish_s"] = round(t_pub - t0, 3)
    out["rss_before_mib"] = round(rss0 / 2**20, 1)
    out["rss_after_mib"] = round(rss1 / 2**20, 1)
    out["rss_bytes_per_pair"] = round((rss1 - rss0) / wl.pairs, 1)
    held = server.count()
    out["held_after_stores"] = held
    if lag:
        lag1 = lag()
        out["store_loop_lag"] = lag_between(lag0, lag1)
    if held != baseline + wl.pairs + W:
        out["count_mismatch"] = f"held {held}, expected {baseline + wl.pairs + W}"

    cpu0 = cpu_seconds(proc.p.pid)
    t0 = time.perf_counter()
    publish(wl.remove_order, wl.removes, wl.sentinel_remove)
    t1 = wait_until(removed_done, WAIT_S, f"{kind}: removals", proc)
    out["remove_blocks_per_s"] = round(wl.pairs / (t1 - t0))
    out["remove_s"] = round(t1 - t0, 3)
    out["remove_cpu_s"] = round(cpu_seconds(proc.p.pid) - cpu0, 3)
    if lag:
        out["remove_loop_lag"] = lag_between(lag1, lag())
    held = server.count()
    if held != baseline:
        out["count_mismatch_after_removals"] = f"held {held}, expected {baseline}"

    # re-populate (untimed) for the route phase
    publish(wl.order, wl.stores, wl.sentinel_store)
    wait_until(stored_done, WAIT_S, f"{kind}: re-populate", proc)
    return out


def _turns(n: int, count: int) -> range | reversed[int]:
    """The order the systems are asked in for the n-th request: swapped every request."""
    return range(count) if n % 2 == 0 else reversed(range(count))


def route_latency(servers: list[Kvctl | Dynamo], wl: Workload, requests: int) -> list[dict[str, Any]]:
    """Each query sent to every system in turn (the order swapped every query), so that the machine's drift
    over the phase weighs on all of them alike; then the same alternation on a trivial GET."""
    for q in wl.queries[:20]:
        for server in servers:
            server.route(q)
    lat: list[list[float]] = [[] for _ in servers]
    overlaps: list[list[int]] = [[] for _ in servers]
    for n, q in enumerate(wl.queries[20:20 + requests]):
        for i in _turns(n, len(servers)):
            s = time.perf_counter()
            overlaps[i].append(servers[i].route(q))
            lat[i].append(time.perf_counter() - s)
    pings: list[list[float]] = [[] for _ in servers]
    for n in range(100):
        for i in _turns(n, len(servers)):
            s = time.perf_counter()
            servers[i].ping()
            pings[i].append(time.perf_counter() - s)
    return [{"route_requests": len(lat[i]), "route_p50_ms": round(_pct(lat[i], 0.5) * 1e3, 3),
             "route_p99_ms": round(_pct(lat[i], 0.99) * 1e3, 3),
             "route_overlap_mean": round(statistics.fmean(overlaps[i]), 2),
             # the same keep-alive client on a trivial GET: the HTTP/TCP floor under the route figures
             "health_get_p50_ms": round(_pct(pings[i], 0.5) * 1e3, 3)} for i in range(len(servers))]


RATIO_KEYS = ("store_blocks_per_s", "remove_blocks_per_s", "store_cpu_s", "remove_cpu_s", "route_p50_ms",
              "route_p99_ms", "rss_bytes_per_pair")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", default="16,128", help="comma-separated engine counts (default 16,128)")
    ap.add_argument("--pairs", type=int, default=100_000, help="(worker, block) pairs to store (default 100k)")
    ap.add_argument("--requests", type=int, default=300, help="route requests timed (default 300)")
    ap.add_argument("--quick", action="store_true", help="16 workers, 20k pairs")
    ap.add_argument("--no-oracle", action="store_true", help="skip Dynamo's indexer")
    ap.add_argument("--dynamo-threads", type=int, default=None, help="dynamo.indexer --threads (its default: 4)")
    args = ap.parse_args()
    if args.quick:
        args.workers, args.pairs = "16", 20_000
    self_check()
    oracle = None if args.no_oracle else (
        None if importlib.util.find_spec("dynamo") is None else "dynamo")
    for W in (int(x) for x in args.workers.split(",")):
        wl = Workload(W, args.pairs)
        row: dict[str, Any] = {"workers": W, "pairs": wl.pairs, "requests_per_engine": len(wl.order) / W,
                               "cpus": os.cpu_count(),
                               "poll_s": POLL_S}
        systems: dict[str, Running] = {}
        try:
            systems["kvctl"] = Running("kvctl", wl, None)
            row["kvctl"] = ingest("kvctl", systems["kvctl"], wl)
            if args.no_oracle:
                row["dynamo"] = "skipped (--no-oracle)"
            elif oracle is None:
                row["dynamo"] = "skipped (ai-dynamo-runtime not installed: `import dynamo` fails)"
            else:
                try:
                    systems["dynamo"] = Running("dynamo", wl, args.dynamo_threads)
                    row["dynamo"] = ingest("dynamo", systems["dynamo"], wl)
                except Exception as exc:  # keep the kvctl figures
                    row["dynamo"] = f"skipped ({type(exc).__name__}: {exc})"  # closed below with the rest
            routed = [name for name in systems if isinstance(row[name], dict)]
            servers = [server for name in routed if (server := systems[name].server) is not None]
            for name, latency in zip(routed, route_latency(servers, wl, args.requests), strict=True):
                row[name].update(latency)
        finally:
            for running in systems.values():
                running.close()
        if isinstance(row["dynamo"], str):
            print(f"dynamo: {row['dynamo']}", file=sys.stderr)
        else:
            k, d = row["kvctl"], row["dynamo"]
            row["ratio_kvctl_over_dynamo"] = {key: round(k[key] / d[key], 3) if d.get(key) else None
                                              for key in RATIO_KEYS}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
