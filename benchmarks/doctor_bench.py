"""Wall time of `kvctl doctor` against a router holding W workers and N (worker, block) pairs.

    python benchmarks/doctor_bench.py [--workers 128] [--blocks 1000000] [--runs 5] [--peer]

The router (`kvctl serve`) is filled over `POST /v1/events`: per worker, chains of 64 blocks under 8
shared system prompts, so the index has the shape of a real fleet (shared roots, private suffixes).
Each run is a fresh `kvctl doctor` process with bytecode caches (see cli_bench.py). Prints one JSON
line. Target (issue 10): under 5 s at 128 workers and 1M blocks. With --peer, `doctor --peer` against a
second router filled alike is timed too: it reads both indexes whole (two 1M-block dumps) to diff them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
from _procs import Proc  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvctl.core.hashing import local_block_hashes, sequence_hashes  # noqa: E402

BLOCK, CHAIN, PROMPTS = 16, 64, 8
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
KVCTL = [str(Path(sys.executable).parent / "kvctl")]


def chains(worker: int, count: int) -> Iterator[str]:
    """RouterEvent JSON lines: the worker's copy of a shared prompt, then private 64-block suffixes."""
    for n in range(count):
        prompt = [p * 1_000_000 + t for p in (n % PROMPTS,) for t in range(CHAIN * BLOCK)]
        tokens = prompt + [worker * 10_000_000 + n * CHAIN * BLOCK + t for t in range(CHAIN * BLOCK)]
        local = local_block_hashes(tokens, BLOCK)
        seq = sequence_hashes(local)
        start = 0 if n < PROMPTS else CHAIN  # the prompt once per worker, then suffixes under it
        parent = None if start == 0 else seq[start - 1]
        blocks = [{"block_hash": s, "tokens_hash": h} for s, h in zip(seq[start:], local[start:], strict=True)]
        yield json.dumps({"worker_id": worker, "event": {"event_id": n, "data": {"stored": {
            "parent_hash": parent, "blocks": blocks}}}})


def fill(http: httpx.Client, workers: int, blocks: int) -> int:
    per_worker = blocks // workers
    count = max(PROMPTS, (per_worker - PROMPTS * CHAIN * 2) // CHAIN + PROMPTS)
    for w in range(1, workers + 1):
        body = "\n".join(chains(w, count))
        answer = http.post("/v1/events", content=body, headers={"content-type": "application/x-ndjson"}).json()
        assert not answer["rejected"], answer
    return int(http.get("/v1/tree/stats").json()["models"]["default"]["blocks"])


@contextmanager
def filled_router(workers: int, blocks: int) -> Iterator[tuple[str, int, float]]:
    """A fresh `kvctl serve` filled as described above: its URL, the blocks it holds, the seconds filling took."""
    with tempfile.TemporaryDirectory() as state:
        proc = Proc([sys.executable, "-m", "kvctl", "serve", "--listen", "127.0.0.1:0", "--state-dir", state,
                     "--no-restore", "--snapshot-interval", "86400"])
        try:
            if not proc.first.wait(60):
                raise RuntimeError(f"kvctl serve printed no URL: {proc.tail()}")
            url = proc.first_line.strip()
            with httpx.Client(base_url=url, timeout=120) as http:
                started = time.perf_counter()
                held = fill(http, workers, blocks)
                yield url, held, time.perf_counter() - started
        finally:
            proc.stop()


def timed(argv: list[str], runs: int) -> tuple[list[float], dict[str, object]]:
    """Wall times of `runs` fresh doctor processes (after one warm-up for bytecode caches), and the last report."""
    subprocess.run(argv, capture_output=True, env=ENV)
    times, report = [], {}
    for _ in range(runs):
        t0 = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, env=ENV, text=True)
        times.append(time.perf_counter() - t0)
        report = json.loads(done.stdout)
    return times, report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--peer", action="store_true", help="also time `doctor --peer` against a second, equal router")
    args = ap.parse_args()
    with ExitStack() as stack:
        url, held, fill_s = stack.enter_context(filled_router(args.workers, args.blocks))
        argv = [*KVCTL, "--server", url, "--timeout", "60", "doctor", "-o", "json"]
        times, report = timed(argv, args.runs)
        out: dict[str, object] = {
            "workers": args.workers, "blocks": held, "fill_s": round(fill_s, 1),
            "doctor_median_s": round(statistics.median(times), 3), "doctor_max_s": round(max(times), 3),
            "status": report["status"], "runs": args.runs, "cpus": os.cpu_count()}
        if args.peer:
            peer, _, _ = stack.enter_context(filled_router(args.workers, args.blocks))
            times, report = timed([*argv, "--peer", peer], args.runs)
            [compared] = [f for f in report["findings"] if f["check"] == "divergence"]  # type: ignore[union-attr]
            out.update(peer_median_s=round(statistics.median(times), 3), peer_max_s=round(max(times), 3),
                       peer_finding=compared["cause"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
