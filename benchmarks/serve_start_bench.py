"""How soon `kvctl serve` opens its port: from the process's start to the first accepted connection (`open_s`, as
scale_bench.py's restart row), to the URL on its stdout (`url_s`: printed once it serves) and to the first `GET
/healthz` answered (`healthz_s`, liveness), median of N starts, with an empty state dir and
with one that has an index to restore (issue 27: the port opens in < 1 s whatever the index size).

    python benchmarks/serve_start_bench.py [--runs 10] [--pairs 200000]

Prints one JSON line. Run it in two checkouts with benchmarks/side_by_side.py to compare a change.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # as installed: bytecode cached
BLOCKS_PER_EVENT = 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(state_dir: str, *extra: str) -> tuple[subprocess.Popen[bytes], dict[str, float], str]:
    """A router; returns it, the seconds to its port's opening and to its URL line, and the URL."""
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "kvctl", "serve", "--listen", f"127.0.0.1:{port}",
                             "--state-dir", state_dir, *extra], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    while proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.002)
    times = {"open_s": time.perf_counter() - t0}
    assert proc.stdout is not None
    url = proc.stdout.readline().decode().strip()  # printed once it serves: after the port opened
    times["url_s"] = time.perf_counter() - t0
    if not url.startswith("http://"):
        proc.kill()
        raise SystemExit(f"kvctl serve printed {url!r}, exit {proc.wait()}")
    return proc, times, url


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)


def fill(state_dir: str, pairs: int) -> None:
    """An index of about `pairs` (worker, block) pairs in state_dir, left there by a clean stop."""
    proc, _, url = start(state_dir, "--no-restore")
    try:
        with httpx.Client(base_url=url, timeout=120) as http:
            events, h = [], 1
            for event_id in range(pairs // BLOCKS_PER_EVENT):
                blocks = [{"block_hash": h + i, "tokens_hash": h + i} for i in range(BLOCKS_PER_EVENT)]
                events.append({"worker_id": 1 + event_id % 8, "event": {"event_id": event_id, "data": {
                    "stored": {"parent_hash": None, "blocks": blocks}}}})
                h += BLOCKS_PER_EVENT
            http.post("/v1/events", json=events).raise_for_status()
    finally:
        stop(proc)


def live(url: str) -> None:
    """Once `GET /healthz` answers 200 (the connection waits in the listen backlog until the server serves)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", "/healthz")
    status = conn.getresponse().status
    conn.close()
    assert status == 200, status


def starts(state_dir: str, runs: int) -> dict[str, float]:
    """Median seconds to the port's opening, the URL line and the first answer of /healthz over `runs` starts,
    and the slowest opening."""
    rows = []
    for _ in range(runs):
        t0 = time.perf_counter()
        proc, times, url = start(state_dir)
        live(url)
        rows.append({**times, "healthz_s": time.perf_counter() - t0})
        stop(proc)
    medians = {key: round(statistics.median(row[key] for row in rows), 3) for key in rows[0]}
    return {**medians, "open_max_s": round(max(row["open_s"] for row in rows), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--pairs", type=int, default=200_000, help="Pairs in the index the restoring starts restore.")
    args = ap.parse_args()
    subprocess.run([sys.executable, "-m", "kvctl", "--version"], check=True, capture_output=True, env=ENV)  # caches
    with tempfile.TemporaryDirectory(prefix="start-empty-") as empty, \
            tempfile.TemporaryDirectory(prefix="start-full-") as full:
        fill(full, args.pairs)
        row = {"runs": args.runs, "pairs": args.pairs, "empty": starts(empty, args.runs),
               "restoring": starts(full, args.runs)}
    print(json.dumps(row))


if __name__ == "__main__":
    main()
