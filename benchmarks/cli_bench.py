"""Wall time of the commands people and runbooks type most: `kvctl --version` and `kvctl tree stats`
against a local router holding Dynamo's fixture dump (median of N runs, each a fresh process).

    python benchmarks/cli_bench.py [--runs 10]

Prints one JSON line. Targets (issue 7): --version <= 150 ms, tree stats <= 300 ms.

Measured as installed kvctl runs: with bytecode caches. PYTHONDONTWRITEBYTECODE (set in some sandboxes
and CI images) would make every run recompile kvctl's sources, a cost no user's second call pays; it
is unset for the runs, and one untimed warm-up run writes the caches.
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
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
DUMP = Path(os.environ.get("KVCTL_FIXTURES", ROOT / "tests" / "fixtures")) / "dynamo-1.6.1" / "dump.jsonl"
KVCTL = [str(Path(sys.executable).parent / "kvctl")]


ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def wall(argv: list[str], runs: int) -> dict[str, float]:
    subprocess.run(argv, check=True, capture_output=True, env=ENV)  # warm-up: writes the bytecode caches
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True, env=ENV)
        times.append((time.perf_counter() - started) * 1000)
    return {"median_ms": round(statistics.median(times), 1), "min_ms": round(min(times), 1),
            "max_ms": round(max(times), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as state, subprocess.Popen(
            [*KVCTL, "serve", "--listen", "127.0.0.1:0", "--state-dir", state, "--no-restore"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as router:
        try:
            assert router.stdout is not None
            url = router.stdout.readline().strip()
            httpx.post(f"{url}/v1/events", content=DUMP.read_bytes(),
                       headers={"content-type": "application/x-ndjson"}).raise_for_status()
            result = {
                "version": wall([*KVCTL, "--version"], args.runs),
                "tree_stats": wall([*KVCTL, "--server", url, "tree", "stats"], args.runs),
                "runs": args.runs, "cpus": os.cpu_count(),
            }
        finally:
            router.terminate()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
