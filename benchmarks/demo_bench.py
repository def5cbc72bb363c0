"""`kvctl demo` as a benchmark (issue 26): the router against random placement at equal offered load and at
capacity, medians over runs, with each process's CPU and, with --profile, py-spy profiles of all three.

    python benchmarks/demo_bench.py [--runs 3] [--duration 60] [--profile DIR]

Prints one JSON line: per run, the demo's own JSON; then the medians of the figures the issue asks about.
With --profile, py-spy (it must be installed: pip install py-spy) records the load generator, the engines and
the router at 200 Hz for 10 s during the open-loop router phase (the last quarter) of the first run, and prints
each process's top functions by own samples.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvctl.process_cpu import process_tree

KVCTL = [sys.executable, "-m", "kvctl"]


def one_run(duration: float, profile: Path | None) -> dict[str, Any]:
    demo = subprocess.Popen([*KVCTL, "demo", "--duration", f"{duration:g}", "-o", "json"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
    if profile is not None:
        time.sleep(3 + duration * 0.8)  # into the open-loop router phase, the last quarter
        _record(demo.pid, profile)
    out, _ = demo.communicate()
    if demo.returncode != 0:
        raise SystemExit(f"kvctl demo exited {demo.returncode}")
    return json.loads(out)


def _record(demo_pid: int, profile: Path) -> None:
    """py-spy on the demo (the load generator) and its children: the router and the engines."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    profile.mkdir(parents=True, exist_ok=True)
    spies = []
    for pid in process_tree(demo_pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        name = "router" if b"serve" in cmdline else "engines" if b"mock" in cmdline else \
            "load-generator" if pid == demo_pid else None
        if name is not None:
            spies.append((name, subprocess.Popen([py_spy, "record", "-d", "10", "-r", "200", "-p", str(pid),
                                                  "--format", "raw", "-o", str(profile / f"{name}.txt"),
                                                  "--nonblocking"], stdout=subprocess.DEVNULL,
                                                 stderr=subprocess.DEVNULL)))
    for _, spy in spies:
        spy.wait()


def top_functions(raw: Path, count: int = 8) -> list[tuple[str, float]]:
    """The functions with the most own samples in a py-spy raw (collapsed) profile, as shares of all samples."""
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        if stack:
            own[stack.rsplit(";", 1)[-1]] += int(samples)
            total += int(samples)
    return [(frame, round(n / total, 3)) for frame, n in own.most_common(count)] if total else []


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def med(path: tuple[str, ...]) -> float | None:
        values = []
        for run in runs:
            value: Any = run
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
            if isinstance(value, (int, float)):
                values.append(value)
        return round(statistics.median(values), 2) if values else None

    out: dict[str, Any] = {"offered_per_s": med(("offered_per_s",))}
    for policy in ("random", "router"):
        out[f"capacity_{policy}_per_s"] = med(("capacity", policy, "best", "requests_per_s"))
        for key in ("hit_rate", "requests_per_s", "goodput_per_s", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms",
                    "e2e_p50_ms"):
            out[f"open_{policy}_{key}"] = med(("open_loop", policy, key))
    for call in ("route", "prefill_complete", "free"):
        for q in ("p50", "p99"):
            out[f"router_{call}_{q}_ms"] = med(("open_loop", "router", "router_calls_ms", call, q))
    for q in ("p50", "p99"):
        out[f"route_decision_{q}_ms"] = med(("open_loop", "router", "route_decision_ms", q))
    for name in ("load generator", "engines", "router"):
        out[f"cpu_cores_{name.replace(' ', '_')}"] = med(("open_loop", "router", "cpu_cores", name))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--profile", type=Path, help="write py-spy profiles here (first run only)")
    args = ap.parse_args()
    runs = [one_run(args.duration, args.profile if i == 0 else None) for i in range(args.runs)]
    result: dict[str, Any] = {"cpus": os.cpu_count(), "duration_s": args.duration, "runs": args.runs,
                              "medians": medians(runs), "each": runs}
    if args.profile is not None:
        result["profile_top"] = {raw.stem: top_functions(raw) for raw in sorted(args.profile.glob("*.txt"))}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
