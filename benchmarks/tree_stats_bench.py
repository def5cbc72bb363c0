"""`kvctl tree stats` at scale: what it costs the client, and what routes wait meanwhile.

A `kvctl serve` is loaded with N (worker, block) pairs of index_bench's synthetic workload (shared 64-block
prompts, unique tails, 1 request in 32 a 1024-block document). The stats are then read each way in a fresh
`kvctl` process: the router's dump replayed in the client (`tree dump URL --format stats`, what `tree stats`
did before), the router computing them (`tree stats URL`), a dump file replayed (`tree dump FILE --format
stats`) and streamed (`tree stats FILE`). For each: wall time and the client's peak RSS; against the router,
also the latency of `POST /v1/route` probes sent every millisecond meanwhile (p50, p99, max), and the router's
own account of its loop (`/v1/status` → `loop`): seconds held past 10 ms, the longest stall of the last minute.

    python benchmarks/tree_stats_bench.py                      # 1M pairs, 64 workers
    python benchmarks/tree_stats_bench.py --pairs 100000       # quicker
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _procs import ROOT, Proc  # noqa: E402
from index_bench import _events, synthetic  # noqa: E402

from kvctl.core.events.dynamo import encode_router_event_json  # noqa: E402

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


def client_run(args: list[str], prober: Prober | None) -> dict[str, float | None]:
    """One `kvctl` process: its wall time, peak RSS, and the probes' latencies meanwhile."""
    if prober is not None:
        prober.samples, prober.measuring = [], True
        held_before = prober.loop()["blocked_s"]
    start = time.perf_counter()
    # Started from a small wrapper: a child forked from this process (the workload in memory) would count
    # this process' pages in its peak RSS until it execs.
    result = subprocess.run([sys.executable, "-c", _PEAK_OF_CHILD, sys.executable, "-m", "kvctl", *args, "-o", "json"],
                            cwd=ROOT, capture_output=True, text=True, check=False)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=64)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = Proc([sys.executable, "-m", "kvctl", "serve", "--listen", "127.0.0.1:0", "--no-restore",
                       "--state-dir", tmp, "--snapshot-interval", "86400"])
        try:
            assert server.first.wait(60), server.tail()
            url = server.first_line.strip()
            started = time.perf_counter()
            probe = load(url, opts.pairs, opts.workers)
            print(f"loaded {opts.pairs} pairs x {opts.workers} workers in {time.perf_counter() - started:.0f} s")
            dump = Path(tmp) / "dump.jsonl"
            dump.write_bytes(httpx.get(f"{url}/v1/tree", params={"format": "jsonl"}, timeout=600).content)
            dump_mb = round(dump.stat().st_size / 2**20)
            prober = Prober(url, probe)
            try:
                time.sleep(1)
                against = ["--server", url, "--timeout", "900", "tree"]  # the router takes ~25 s at 1M
                rows = {"idle (no client)": client_run(["--version"], prober),
                        "router, dump replayed in the client (before)":
                            client_run([*against, "dump", "--format", "stats"], prober),
                        "router computes them (after)": client_run([*against, "stats"], prober)}
            finally:
                prober.close()
            rows["dump file replayed (before)"] = client_run(["tree", "dump", str(dump), "--format", "stats"], None)
            rows["dump file streamed (after)"] = client_run(["tree", "stats", str(dump)], None)
        finally:
            server.stop()
    print(json.dumps({"pairs": opts.pairs, "workers": opts.workers, "dump_mb": dump_mb, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
