"""What grows with the index: `kvctl serve` at 1M, 4M and 10M (worker, block) pairs, Dynamo's indexer beside it.

Routing itself is flat in the index's size; everything around it (snapshots, dumps, stats, bulk loads,
shutdown, restart, ingest, memory) may not be. Per size, on one workload (W engines publishing vLLM's ZMQ
wire; shared system prompts of 8-64 blocks, each request adding a unique 8-64-block tail; the first
request of an engine for a prompt stores it from the root), this measures the rows of issue 27's table:

  - ingest: blocks/s over the whole load, and over its first and last quarter (does it slow as it grows?);
    RSS per pair; the same for `dynamo.indexer` (ingest timed to a sentinel block, as serve_bench does);
  - route stalls, by a prober sending a 2,048-token route back to back on one keep-alive connection:
    its p50 and max while idle, over a window of the periodic work (1.2 snapshot intervals: a state log's
    fsyncs and one fold of it in a child, or an older router's full snapshots), during a `GET /v1/tree`,
    and during bulk `POST /v1/events` (2,000-event batches from one client);
  - `kvctl tree stats` against the router: wall time and the client's peak RSS; the router's answer alone, and
    the routes answered during it;
  - disk written per snapshot interval (the router's `/proc/PID/io` write_bytes over the window);
  - SIGTERM to exit; then a restart on the same state dir: time until its port accepts a connection, until
    `/healthz` answers (the server serves), until `/readyz` says ready, and until the index holds every pair.

    python benchmarks/scale_bench.py [--sizes 1000000,4000000,10000000] [--workers 64] [--no-oracle]

Prints one JSON line per size. It is not part of the test run: at 10M it takes several minutes and
gigabytes of memory. The machine's core count matters: publishers, server, prober and client share it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from pathlib import Path
from typing import Any

import httpx
from _procs import Proc, rss_bytes
from serve_bench import (
    BLOCK,
    Dynamo,
    Publishers,
    chain,
    free_port,
    payload,
    self_check,
    stored_event,
    wait_until,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvctl.core.events import RouterEvent, Stored  # noqa: E402
from kvctl.core.events.dynamo import encode_router_event_json  # noqa: E402
from kvctl.process_cpu import process_tree  # noqa: E402

PROMPTS = 256
PROMPT_BLOCKS = (8, 64)
TAIL_BLOCKS = (8, 64)
BULK_BATCH = 2_000
BULK_BATCHES = 10
STATS_TIMEOUT_S = 600.0
FOLD_TIMEOUT_S = 900.0


def _tokens(rng: random.Random, blocks: int) -> list[int]:
    return [t % 32_000 for t in array("H", rng.randbytes(2 * BLOCK * blocks))]


class Workload:
    """Pre-encoded store payloads in publish order, and a sentinel block every engine stores last."""

    def __init__(self, workers: int, pairs: int, seed: int = 27) -> None:
        rng = random.Random(seed)
        self.workers = workers
        prompts = [_tokens(rng, rng.randint(*PROMPT_BLOCKS)) for _ in range(PROMPTS)]
        prompt_hashes = [chain(None, p) for p in prompts]
        held: set[tuple[int, int]] = set()
        self.messages: list[tuple[int, bytes]] = []
        self.pairs = 0
        i = 0
        while self.pairs < pairs:
            w, p = i % workers, rng.randrange(PROMPTS)
            i += 1
            tail = _tokens(rng, rng.randint(*TAIL_BLOCKS))
            tail_hashes = chain(prompt_hashes[p][-1], tail)
            if (w, p) in held:
                event, blocks = stored_event(tail_hashes, prompt_hashes[p][-1], tail), len(tail_hashes)
            else:
                held.add((w, p))
                event = stored_event(prompt_hashes[p] + tail_hashes, None, prompts[p] + tail)
                blocks = len(prompt_hashes[p]) + len(tail_hashes)
            self.pairs += blocks
            self.messages.append((w, payload([event], 1.7e9)))
        self.sentinel_tokens = _tokens(rng, 1)
        self.sentinel = payload([stored_event(chain(None, self.sentinel_tokens), None, self.sentinel_tokens)], 1.7e9)
        self.query = prompts[0] + _tokens(rng, (2048 - len(prompts[0])) // BLOCK)
        self.total = self.pairs + workers  # with the sentinel

    def publish(self, pubs: Publishers) -> None:
        for w, body in self.messages:
            pubs.send(w, body)
        for w in range(self.workers):
            pubs.send(w, self.sentinel)


class Router:
    """A `kvctl serve` on a fixed port (so that a restart can be watched opening it), engines by flag."""

    def __init__(self, endpoints: list[str], state_dir: str, port: int, *, restore: bool,
                 snapshot_interval_s: float, compact_log_bytes: int | None = None) -> None:
        argv = [sys.executable, "-m", "kvctl", "serve", "--listen", f"127.0.0.1:{port}", "--state-dir", state_dir,
                "--snapshot-interval", str(snapshot_interval_s), "--max-engines", str(max(64, len(endpoints)))]
        self.state_dir, self.snapshot_interval_s = Path(state_dir), snapshot_interval_s
        if not restore:
            argv.append("--no-restore")
        if compact_log_bytes is not None and _has_state_log():
            argv += ["--compact-log-bytes", str(compact_log_bytes)]
        for w, endpoint in enumerate(endpoints):
            argv += ["--worker", f"{w + 1}:0={endpoint}"]
        self.started = time.perf_counter()
        self.proc = Proc(argv)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def port_open(self) -> bool:
        with socket.socket() as s:
            s.settimeout(0.2)
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def count(self) -> int:
        try:
            answer = self.http.get("/v1/tree/stats")
        except httpx.TransportError:
            return -1
        if answer.status_code != 200:
            return -1
        model = answer.json()["models"].get("default")
        return sum(model["workers"].values()) if model else 0

    def log_stats(self) -> dict[str, Any] | None:
        """The state log's figures (`/v1/status` `restore.log`); None for a router that writes full snapshots."""
        restore = self.http.get("/v1/status").raise_for_status().json().get("restore") or {}
        return restore.get("log")

    def loop_held(self) -> tuple[float, int] | None:
        """Seconds the router's loop was held past its tolerance, and in how many stalls, since it started."""
        loop = self.http.get("/v1/status").raise_for_status().json().get("loop")
        return (loop["blocked_s"], loop["stalls"]) if loop and "blocked_s" in loop else None

    def folding(self) -> bool:
        """Whether a compaction child (`kvctl.server.persistence.fold`) of the router runs now."""
        for pid in process_tree(self.proc.p.pid)[1:]:
            with contextlib.suppress(OSError):
                if b"persistence.fold" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return True
        return False

    def written_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.p.pid}/io").read_text().splitlines():
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
        raise RuntimeError("no write_bytes in /proc/PID/io")

    def stop(self) -> None:
        self.http.close()
        self.proc.stop()


class Prober(threading.Thread):
    """Routes back to back on one connection, each sample (start, seconds), until stopped."""

    def __init__(self, url: str, tokens: list[int]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, json.dumps({"token_ids": tokens}).encode()
        self.samples: list[tuple[float, float]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60, headers={"content-type": "application/json"}) as http:
            while not self.halt.is_set():
                t0 = time.perf_counter()
                http.post("/v1/route", content=self.body).raise_for_status()
                self.samples.append((t0, time.perf_counter() - t0))

    def between(self, t0: float, t1: float) -> dict[str, Any]:
        """The routes that overlapped [t0, t1]: count, p50, p99, max (ms)."""
        window = sorted(s for start, s in self.samples if start <= t1 and start + s >= t0)
        if not window:
            return {"routes": 0}
        def at(q: float) -> float:
            return round(window[min(len(window) - 1, int(q * len(window)))] * 1e3, 2)
        return {"routes": len(window), "p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": round(window[-1] * 1e3, 2)}

    def stop(self) -> None:
        self.halt.set()
        self.join(60)


def ingest_kvctl(router: Router, pubs: Publishers, wl: Workload) -> dict[str, Any]:
    """Blocks/s over the load, and over its first and last quarter as the index fills."""
    wait_until(lambda: router.count() >= 0, 120, "kvctl: up", router.proc)
    deadline = time.perf_counter() + 60
    while router.count() < wl.workers:  # slow joiner: each engine stores the sentinel until all are subscribed
        if time.perf_counter() > deadline:
            raise RuntimeError(f"kvctl: engines not subscribed: {router.proc.tail()}")
        for w in range(wl.workers):
            pubs.send(w, wl.sentinel)
        time.sleep(0.05)
    rss0 = rss_bytes(router.proc.p.pid)
    progress: list[tuple[float, int]] = []
    publisher = threading.Thread(target=wl.publish, args=(pubs,))
    t0 = time.perf_counter()
    publisher.start()
    while (held := router.count()) < wl.total:
        progress.append((time.perf_counter(), held))
        if router.proc.p.poll() is not None or time.perf_counter() - t0 > 900:
            raise RuntimeError(f"kvctl: ingest stuck at {held}/{wl.total}: {router.proc.tail()}")
        time.sleep(0.2)
    t1 = time.perf_counter()
    publisher.join()
    progress.append((t1, wl.total))

    def rate(lo: float, hi: float) -> int | None:
        """Blocks/s between the polls that first saw lo and hi of the load held; None when one poll saw both."""
        a = next(p for p in progress if p[1] - wl.workers >= lo * wl.pairs)
        b = next(p for p in progress if p[1] - wl.workers >= hi * wl.pairs)
        return round((b[1] - a[1]) / (b[0] - a[0])) if b[0] > a[0] else None

    return {"blocks_per_s": round(wl.pairs / (t1 - t0)), "first_quarter_blocks_per_s": rate(0.0, 0.25),
            "last_quarter_blocks_per_s": rate(0.75, 1.0),
            "rss_bytes_per_pair": round((rss_bytes(router.proc.p.pid) - rss0) / wl.pairs, 1)}


def ingest_dynamo(wl: Workload, threads: int | None) -> dict[str, Any]:
    pubs = Publishers(wl.workers)
    dynamo = Dynamo(pubs.endpoints(), threads)
    try:
        deadline = time.perf_counter() + 60
        while dynamo.holders(wl.sentinel_tokens) < wl.workers:
            if time.perf_counter() > deadline:
                raise RuntimeError(f"dynamo: engines not subscribed: {dynamo.proc.tail()}")
            for w in range(wl.workers):
                pubs.send(w, wl.sentinel)
            time.sleep(0.05)
        # the sentinel is held already: publish the load, then a second sentinel the phase ends on
        second = _tokens(random.Random(1), 1)
        end = payload([stored_event(chain(None, second), None, second)], 1.7e9)
        rss0 = rss_bytes(dynamo.proc.p.pid)
        t0 = time.perf_counter()
        for w, body in wl.messages:
            pubs.send(w, body)
        for w in range(wl.workers):
            pubs.send(w, end)
        wait_until(lambda: dynamo.holders(second) == wl.workers, 900, "dynamo: ingest", dynamo.proc)
        t1 = time.perf_counter()
        return {"blocks_per_s": round(wl.pairs / (t1 - t0)),
                "rss_bytes_per_pair": round((rss_bytes(dynamo.proc.p.pid) - rss0) / wl.pairs, 1)}
    finally:
        dynamo.stop()
        pubs.close()


def _has_state_log() -> bool:
    """Whether this checkout's router keeps a state log (it takes --compact-log-bytes): the benchmark also runs
    in older checkouts (side_by_side.py), whose routers write snapshot.jsonl whole every interval."""
    return "--compact-log-bytes" in subprocess.run([sys.executable, "-m", "kvctl", "serve", "--help"], cwd=ROOT,
                                                   capture_output=True, text=True, env={**os.environ,
                                                   "COLUMNS": "300"}).stdout


def snapshot_window(router: Router, prober: Prober) -> dict[str, Any]:
    """Routes over 1.2 snapshot intervals, and what the router's periodic work wrote meanwhile (its
    /proc/PID/io write_bytes, with its reaped children's, per interval).

    A router with a state log fsyncs it every interval and folds it into a new image in a child process when
    due (`--compact-log-bytes`, small here so that the first interval folds the ingest): the folds that ran,
    each child's lifetime (the window waits for one under way) and the routes while one ran. An older router
    writes snapshot.jsonl whole every interval, on its loop: the snapshots seen (the file's mtime)."""
    def stamp() -> float:
        snapshot = router.state_dir / "snapshot.jsonl"
        return snapshot.stat().st_mtime if snapshot.exists() else 0.0
    log0 = router.log_stats()
    written0, seen, snapshots = router.written_bytes(), stamp(), 0
    folds: list[tuple[float, float]] = []
    fold_from: float | None = None
    t0 = time.perf_counter()
    while (now := time.perf_counter()) - t0 < 1.2 * router.snapshot_interval_s or fold_from is not None:
        if now - t0 > FOLD_TIMEOUT_S:
            raise RuntimeError(f"a fold ran over {FOLD_TIMEOUT_S} s: {router.proc.tail()}")
        folding = log0 is not None and router.folding()
        if folding and fold_from is None:
            fold_from = now
        elif not folding and fold_from is not None:
            folds.append((fold_from, now))
            fold_from = None
        if (mtime := stamp()) != seen:
            seen, snapshots = mtime, snapshots + 1
        time.sleep(0.05)
    t1 = time.perf_counter()
    intervals = (t1 - t0) / router.snapshot_interval_s
    row: dict[str, Any] = {"kind": "full snapshots" if log0 is None else "state log", "window_s": round(t1 - t0, 1),
                           "routes": prober.between(t0, t1),
                           "mb_written_per_interval": round((router.written_bytes() - written0) / intervals / 1e6, 1)}
    if log0 is None:
        return {**row, "snapshots": snapshots}
    log1 = router.log_stats() or {}
    return {**row, "folds": log1["compactions"] - log0["compactions"], "fold_children_s": [
        round(b - a, 2) for a, b in folds], "fsyncs": log1["fsyncs"] - log0["fsyncs"],
        "log_mb_appended": round((log1["bytes"] - log0["bytes"]) / 1e6, 2),
        "routes_during_fold": prober.between(*folds[0]) if folds else {"routes": 0}}


def during_dump(router: Router, prober: Prober) -> dict[str, Any]:
    """The routes during a `GET /v1/tree`, and the router's own count of its loop held past 10 ms meanwhile
    (`/v1/status` `loop`, where the router has it): the prober's figures include this busy machine's
    scheduling, the loop's are what the router itself saw."""
    loop0 = router.loop_held()
    t0 = time.perf_counter()
    size = 0
    with router.http.stream("GET", "/v1/tree", params={"format": "jsonl"}) as answer:
        for chunk in answer.iter_raw():
            size += len(chunk)
    t1 = time.perf_counter()
    row = {"dump_s": round(t1 - t0, 2), "dump_mb": round(size / 1e6, 1), "routes": prober.between(t0, t1)}
    loop1 = router.loop_held()
    if loop0 is not None and loop1 is not None:
        row["loop_blocked_s"] = round(loop1[0] - loop0[0], 3)
        row["loop_stalls"] = loop1[1] - loop0[1]
    return row


def during_bulk(router: Router, prober: Prober) -> dict[str, Any]:
    """BULK_BATCHES batches of BULK_BATCH stored events (4 blocks each) for a worker of its own."""
    rng = random.Random(5)
    batches = []
    for b in range(BULK_BATCHES):
        events = [RouterEvent(worker_id=10_000, event_id=b * BULK_BATCH + i,
                              data=Stored(parent_hash=None, block_hashes=[rng.getrandbits(63) for _ in range(4)],
                                          tokens_hashes=[rng.getrandbits(63) for _ in range(4)]))
                  for i in range(BULK_BATCH)]
        batches.append(b"\n".join(encode_router_event_json(ev) for ev in events))
    t0 = time.perf_counter()
    per_batch = []
    for body in batches:
        s = time.perf_counter()
        router.http.post("/v1/events", content=body,
                         headers={"content-type": "application/x-ndjson"}).raise_for_status()
        per_batch.append(time.perf_counter() - s)
    t1 = time.perf_counter()
    return {"batch_ms": round(sorted(per_batch)[len(per_batch) // 2] * 1e3, 1), "routes": prober.between(t0, t1)}


def tree_stats_router(router: Router, prober: Prober) -> dict[str, Any]:
    """The router's own part of `kvctl tree stats`, its answer to the `GET /v1/tree/stats?shape=true` the command
    sends (on a busy 2-core machine the command's start, its imports, may cost as much), and the routes answered
    meanwhile."""
    t0 = time.perf_counter()
    router.http.get("/v1/tree/stats", params={"shape": "true"}, timeout=STATS_TIMEOUT_S).raise_for_status()
    t1 = time.perf_counter()
    return {"router_s": round(t1 - t0, 3), "routes": prober.between(t0, t1)}


def tree_stats_cli(router: Router) -> dict[str, Any]:
    """`kvctl tree stats URL -o json` as its own process: wall time and its peak RSS.

    The peak is the exec'd process's own VmHWM, read while it runs: wait4's ru_maxrss would count this
    process's workload too, resident in the child from the fork (or vfork) until its exec."""
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "kvctl", "tree", "stats", router.url, "-o", "json"],
                             cwd=ROOT, stdout=subprocess.DEVNULL)
    peak_kb, deadline = 0, t0 + STATS_TIMEOUT_S
    while child.poll() is None:
        with contextlib.suppress(OSError, IndexError):  # gone, or a zombie with no memory left to show
            status = Path(f"/proc/{child.pid}/status").read_text()
            peak_kb = max(peak_kb, int(status.split("VmHWM:")[1].split()[0]))
        if time.perf_counter() > deadline:
            child.kill()
            child.wait()
            return {"timed_out_s": STATS_TIMEOUT_S, "peak_rss_mb": round(peak_kb / 1024, 1)}
        time.sleep(0.01)
    return {"s": round(time.perf_counter() - t0, 2), "peak_rss_mb": round(peak_kb / 1024, 1),
            "exit": child.returncode}


def stop_and_restart(router: Router, pubs: Publishers, state_dir: str, wl: Workload) -> tuple[Router, dict[str, Any]]:
    t0 = time.perf_counter()
    router.proc.p.send_signal(signal.SIGTERM)
    router.proc.p.wait(600)
    sigterm_s = time.perf_counter() - t0
    router.http.close()
    again = Router(pubs.endpoints(), state_dir, router.port, restore=True,
                   snapshot_interval_s=router.snapshot_interval_s)

    def ready() -> bool:  # GET /readyz 200: the restore is done (a router before /readyz: 404, counted ready)
        try:
            return again.http.get("/readyz").status_code in (200, 404)
        except httpx.TransportError:
            return False

    def live() -> bool:  # GET /healthz answered: the server serves (the port opens before, see `kvctl serve`)
        try:
            return again.http.get("/healthz").status_code == 200
        except httpx.TransportError:
            return False

    opened = wait_until(again.port_open, 600, "restart: port", again.proc)
    lived = wait_until(live, 600, "restart: /healthz 200", again.proc)
    readied = wait_until(ready, 600, "restart: /readyz 200", again.proc)
    whole = wait_until(lambda: again.count() >= wl.total, 600, "restart: index whole", again.proc)
    return again, {"sigterm_to_exit_s": round(sigterm_s, 2), "port_open_s": round(opened - again.started, 2),
                   "live_s": round(lived - again.started, 2), "ready_s": round(readied - again.started, 2),
                   "whole_s": round(whole - again.started, 2)}


def one_size(pairs: int, args: argparse.Namespace, oracle: bool) -> dict[str, Any]:
    workers = args.workers
    t = time.perf_counter()
    wl = Workload(workers, pairs)
    row: dict[str, Any] = {"pairs": wl.pairs, "workers": workers, "messages": len(wl.messages), "cpus": os.cpu_count(),
                           "workload_s": round(time.perf_counter() - t, 1)}
    pubs = Publishers(workers)
    tmp = tempfile.TemporaryDirectory(prefix="scale_bench-")
    router = Router(pubs.endpoints(), tmp.name, free_port(), restore=False,
                    snapshot_interval_s=args.snapshot_interval, compact_log_bytes=args.compact_log_bytes)
    prober: Prober | None = None
    try:
        row["ingest"] = ingest_kvctl(router, pubs, wl)
        prober = Prober(router.url, wl.query)
        prober.start()
        time.sleep(3)
        row["route_idle"] = prober.between(time.perf_counter() - 3, time.perf_counter())
        row["periodic_snapshot"] = snapshot_window(router, prober)
        row["tree_dump"] = during_dump(router, prober)
        row["bulk_events"] = during_bulk(router, prober)
        by_router = tree_stats_router(router, prober)
        prober.stop()
        prober = None
        row["tree_stats"] = {**tree_stats_cli(router), **by_router}
        router, row["restart"] = stop_and_restart(router, pubs, tmp.name, wl)
    finally:
        if prober is not None:
            prober.stop()
        router.stop()
        pubs.close()
        tmp.cleanup()
    if oracle:
        try:
            row["dynamo"] = ingest_dynamo(wl, args.dynamo_threads)
            row["ratio_kvctl_over_dynamo"] = {
                key: round(row["ingest"][key] / row["dynamo"][key], 3)
                for key in ("blocks_per_s", "rss_bytes_per_pair") if row["dynamo"].get(key)}
        except Exception as exc:  # keep kvctl's figures
            row["dynamo"] = f"skipped ({type(exc).__name__}: {exc})"
    else:
        row["dynamo"] = "skipped (--no-oracle, or `import dynamo` fails)"
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000000,4000000,10000000", help="(worker, block) pairs, comma-separated")
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--no-oracle", action="store_true", help="skip Dynamo's indexer")
    ap.add_argument("--snapshot-interval", type=float, default=30.0,
                    help="the router's --snapshot-interval; the snapshot window is 1.2 of it (default 30)")
    ap.add_argument("--compact-log-bytes", type=int, default=1 << 20,
                    help="the router's --compact-log-bytes (a router with a state log): small, so that the "
                         "snapshot window holds the fold of the ingest (default 1 MiB)")
    ap.add_argument("--dynamo-threads", type=int, default=None, help="dynamo.indexer --threads (its default: 4)")
    args = ap.parse_args()
    self_check()
    try:
        import dynamo  # noqa: F401

        oracle = not args.no_oracle
    except ImportError:
        oracle = False
    for size in (int(s) for s in args.sizes.split(",")):
        print(json.dumps(one_size(size, args, oracle)), flush=True)


if __name__ == "__main__":
    main()
