"""`kvctl tree stats` at scale: what it costs the client, and what routes wait meanwhile.

Three sources, each holding N (worker, block) pairs of 64 workers:
- `router`: a `kvctl serve` loaded with index_bench's synthetic workload (shared 64-block prompts, unique tails,
  1 request in 32 a 1024-block document), read each way: its dump replayed in the client (`tree dump URL
  --format stats`, what `tree stats` did before) and the router computing them (`tree stats URL`), with the
  latency of `POST /v1/route` probes sent every millisecond meanwhile (p50, p99, max) and the router's own
  account of its loop (`/v1/status` → `loop`): seconds held past 10 ms, the longest stall of the last minute;
- `file`: the same workload's dump as `kvctl tree dump` writes it (JSONL and a JSON list), `tree stats FILE`;
- `dynamo`: a `dynamo.indexer` fed scale_bench's workload (256 shared prompts of 8-64 blocks, tails of 8-64)
  over ZMQ, `tree stats dynamo+URL` (needs `pip install ai-dynamo-runtime==1.6.1`).
Each is a fresh `kvctl` process: its wall time and peak RSS. `--before DIR` runs the file and Dynamo reads
with a checkout of the code before a change too (its `kvctl` package first on the path), the two in turns,
`--rounds` times each: the medians, side by side, and their ratio.

    python benchmarks/tree_stats_bench.py                      # 1M pairs, every source
    python benchmarks/tree_stats_bench.py --sources file,dynamo --before ../kvctl-main --rounds 3
    python benchmarks/tree_stats_bench.py --pairs 4000000 --sources file,dynamo --before ../kvctl-main
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _procs import ROOT, Proc  # noqa: E402
from index_bench import _events, synthetic  # noqa: E402
from scale_bench import Workload, _tokens  # noqa: E402
from serve_bench import Dynamo, Publishers, chain, payload, stored_event, wait_until  # noqa: E402

from kvctl.core.events.dynamo import encode_router_event_json  # noqa: E402
from kvctl.core.index import KvIndex  # noqa: E402

BATCH = 200
_PEAK_OF_CHILD = ("import resource, subprocess, sys; "
                  "subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, check=True); "
                  "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def load(url: str, pairs: int, workers: int) -> list[int]:
    """Post the workload's stores; returns a probe: the local hashes of its first request."""
    wl = synthetic(pairs, workers)
    stores, _ = _events(wl)
    with httpx.Client(base_url=url, timeout=600) as http:
        for i in range(0, len(stores), BATCH):
            body = b"\n".join(encode_router_event_json(e) for e in stores[i:i + BATCH])
            r = http.post("/v1/events", content=body, headers={"content-type": "application/x-ndjson"})
            r.raise_for_status()
    return list(wl.requests[0][2][:128])


class Prober:
    """`POST /v1/route` every millisecond from a thread, its latencies kept while `measuring`."""

    def __init__(self, url: str, probe: list[int]) -> None:
        self.http = httpx.Client(base_url=url, timeout=30)
        self.body = {"local_hashes": probe}
        self.samples: list[float] = []
        self.running, self.measuring = True, False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.running:
            start = time.perf_counter()
            self.http.post("/v1/route", json=self.body).raise_for_status()
            if self.measuring:
                self.samples.append(time.perf_counter() - start)
            time.sleep(0.001)

    def loop(self) -> dict[str, float]:
        """The router's own account of its loop (`/v1/status` → `loop`): what it was held, whatever the client
        thread's own delays on a busy machine."""
        with httpx.Client(base_url=str(self.http.base_url), timeout=30) as http:
            return http.get("/v1/status").json()["loop"]  # type: ignore[no-any-return]

    def close(self) -> None:
        self.running = False
        self.thread.join()
        self.http.close()


def client_run(args: list[str], prober: Prober | None, checkout: Path = ROOT) -> dict[str, float | None]:
    """One `kvctl` process (of `checkout`'s code): its wall time, peak RSS, and the probes' latencies meanwhile."""
    if prober is not None:
        prober.samples, prober.measuring = [], True
        held_before = prober.loop()["blocked_s"]
    start = time.perf_counter()
    # Started from a small wrapper: a child forked from this process (the workload in memory) would count
    # this process' pages in its peak RSS until it execs.
    result = subprocess.run([sys.executable, "-c", _PEAK_OF_CHILD, sys.executable, "-m", "kvctl", *args, "-o", "json"],
                            cwd=checkout, capture_output=True, text=True, check=False,
                            env={**os.environ, "PYTHONPATH": str(checkout)})
    wall = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    row: dict[str, float | None] = {"wall_s": round(wall, 2), "client_peak_mb": round(int(result.stdout) / 1024)}
    if prober is not None:
        prober.measuring = False
        ms = sorted(s * 1e3 for s in prober.samples)
        loop = prober.loop()
        row.update(routes=len(ms), route_p50_ms=round(statistics.median(ms), 2),
                   route_p99_ms=round(ms[int(0.99 * (len(ms) - 1))], 2), route_max_ms=round(ms[-1], 2),
                   loop_held_past_10ms_s=round(loop["blocked_s"] - held_before, 3),
                   loop_longest_stall_last_minute_ms=round(loop["window_longest_s"] * 1e3 + 10, 1))
    return row


def router_rows(pairs: int, workers: int, tmp: str) -> dict[str, dict[str, float | None]]:
    server = Proc([sys.executable, "-m", "kvctl", "serve", "--listen", "127.0.0.1:0", "--no-restore",
                   "--state-dir", tmp, "--snapshot-interval", "86400"])
    try:
        assert server.first.wait(60), server.tail()
        url = server.first_line.strip()
        started = time.perf_counter()
        probe = load(url, pairs, workers)
        print(f"loaded {pairs} pairs x {workers} workers in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        prober = Prober(url, probe)
        try:
            time.sleep(1)
            against = ["--server", url, "--timeout", "900", "tree"]  # the router takes ~25 s at 1M
            return {"idle (no client)": client_run(["--version"], prober),
                    "router, dump replayed in the client (before)":
                        client_run([*against, "dump", "--format", "stats"], prober),
                    "router computes them (after)": client_run([*against, "stats"], prober)}
        finally:
            prober.close()
    finally:
        server.stop()


def write_dumps(pairs: int, workers: int, tmp: Path) -> dict[str, Path]:
    """The synthetic workload's dump as `kvctl tree dump` writes it: JSONL (`-o json` is a JSON list)."""
    index = KvIndex()
    index.load(_events(synthetic(pairs, workers))[0])
    events = [encode_router_event_json(e) for e in index.dump()]
    del index
    files = {"jsonl": tmp / "dump.jsonl", "json list": tmp / "dump.json"}
    files["jsonl"].write_bytes(b"\n".join(events) + b"\n")
    files["json list"].write_bytes(b"[" + b",\n".join(events) + b"]")
    return files


class FedDynamo:
    """A `dynamo.indexer` holding scale_bench's workload of `pairs`, fed over ZMQ as engines would."""

    def __init__(self, pairs: int, workers: int) -> None:
        wl = Workload(workers, pairs)
        self.pubs = Publishers(workers)
        self.dynamo = Dynamo(self.pubs.endpoints(), None)
        wait_until(lambda: self._subscribed(wl), 60, "dynamo: engines subscribed", self.dynamo.proc)
        last = _tokens(random.Random(1), 1)  # stored last by every engine: held by all, the load is in
        end = payload([stored_event(chain(None, last), None, last)], 1.7e9)
        for w, body in wl.messages:
            self.pubs.send(w, body)
        for w in range(workers):
            self.pubs.send(w, end)
        wait_until(lambda: self.dynamo.holders(last) == workers, 900, "dynamo: ingest", self.dynamo.proc)
        self.url = "dynamo+" + str(self.dynamo.http.base_url).rstrip("/")

    def _subscribed(self, wl: Workload) -> bool:
        for w in range(wl.workers):  # slow joiner: the sentinel until every engine's is held
            self.pubs.send(w, wl.sentinel)
        time.sleep(0.05)
        return self.dynamo.holders(wl.sentinel_tokens) == wl.workers

    def stop(self) -> None:
        self.dynamo.stop()
        self.pubs.close()


def side_by_side(reads: dict[str, list[str]], before: Path | None, rounds: int) -> dict[str, dict[str, Any]]:
    """Each read by this checkout (and `before`'s), in turns, `rounds` times: medians, and after/before."""
    sides = {"after": ROOT, **({"before": before} if before else {})}
    rows: dict[str, dict[str, Any]] = {}
    for name, args in reads.items():
        runs: dict[str, list[dict[str, float | None]]] = {side: [] for side in sides}
        for k in range(rounds):
            for side in (sorted(sides) if k % 2 else sorted(sides, reverse=True)):
                runs[side].append(client_run(args, None, sides[side]))
        row = {side: {key: statistics.median(float(r[key] or 0) for r in got) for key in got[0]}
               for side, got in runs.items()}
        if before:
            row["after/before"] = {key: round(row["after"][key] / row["before"][key], 3) for key in row["after"]
                                   if row["before"][key]}
        rows[name] = row
        print(json.dumps({name: row}), file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--sources", default="router,file,dynamo", help="comma-separated: router, file, dynamo")
    parser.add_argument("--before", type=Path, default=None, help="a checkout of the code before, read beside")
    parser.add_argument("--rounds", type=int, default=1)
    opts = parser.parse_args()
    sources = set(opts.sources.split(","))
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if "router" in sources:
            rows.update(router_rows(opts.pairs, opts.workers, tmp))
        if "file" in sources:
            files = write_dumps(opts.pairs, opts.workers, Path(tmp))
            rows["dump_mb"] = round(files["jsonl"].stat().st_size / 2**20)
            rows.update(side_by_side({f"tree stats FILE ({shape})": ["tree", "stats", str(path)]
                                      for shape, path in files.items()}, opts.before, opts.rounds))
        if "dynamo" in sources:
            fed = FedDynamo(opts.pairs, opts.workers)
            try:
                rows.update(side_by_side({"tree stats dynamo+URL": ["--timeout", "900", "tree", "stats", fed.url]},
                                         opts.before, opts.rounds))
            finally:
                fed.stop()
    print(json.dumps({"pairs": opts.pairs, "workers": opts.workers, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
