"""One benchmark run on two checkouts of kvctl in turns, so that a change is judged against its parent on the
same machine in the same minutes: the figures of two separate runs on a shared 2-core VM drift by more than
the 5 % a refactor may cost.

    python benchmarks/side_by_side.py BEFORE_DIR AFTER_DIR [--rounds 3] -- serve_bench.py --workers 16 --no-oracle

Each directory is a kvctl checkout with its own `.venv` (`pip install -e '.[dev]'`, which builds its C
extension). Round k runs the benchmark in BEFORE then AFTER (AFTER first on odd rounds). Every numeric leaf
of the benchmark's JSON lines is collected, and one JSON line per benchmark row is printed: the median of
each figure on both sides and their ratio (after / before).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any


def leaves(row: Any, prefix: str = "") -> dict[str, float]:
    """`a.b.c` -> number, for every int or float in a JSON value (bools left out)."""
    if isinstance(row, dict):
        return {k: v for key, value in row.items() for k, v in leaves(value, f"{prefix}{key}.").items()}
    if isinstance(row, (int, float)) and not isinstance(row, bool):
        return {prefix.rstrip("."): float(row)}
    return {}


def run_once(checkout: Path, bench: list[str]) -> list[dict[str, float]]:
    python = checkout / ".venv" / "bin" / "python"
    done = subprocess.run([str(python), str(checkout / "benchmarks" / bench[0]), *bench[1:]], cwd=checkout,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: {bench[0]} exited {done.returncode}: {done.stderr[-2000:]}")
    return [leaves(json.loads(line)) for line in done.stdout.splitlines() if line.startswith("{")]


def compare(before: list[list[dict[str, float]]], after: list[list[dict[str, float]]]) -> list[dict[str, Any]]:
    """Per benchmark row: each figure's median before and after, and after / before. A figure some runs lack (a
    timing a run may not see, such as routes during a fold) is the median of the runs that have it."""
    rows = []
    for i in range(len(before[0])):
        keys = sorted({k for run in before for k in run[i]} & {k for run in after for k in run[i]})
        row: dict[str, Any] = {}
        for key in keys:
            b = statistics.median(run[i][key] for run in before if key in run[i])
            a = statistics.median(run[i][key] for run in after if key in run[i])
            row[key] = {"before": b, "after": a, "ratio": round(a / b, 3) if b else None}
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 usage="%(prog)s BEFORE AFTER [--rounds N] -- SCRIPT [ARGS]")
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, bench = ap.parse_args(argv[:cut]), argv[cut + 1:]
    if not bench:
        ap.error("name the benchmark after --, e.g. -- serve_bench.py --workers 16 --no-oracle")
    runs: dict[Path, list[list[dict[str, float]]]] = {args.before: [], args.after: []}
    for k in range(args.rounds):
        for checkout in (args.before, args.after) if k % 2 == 0 else (args.after, args.before):
            runs[checkout].append(run_once(checkout, bench))
            print(f"round {k + 1}/{args.rounds}: {checkout} done", file=sys.stderr, flush=True)
    for row in compare(runs[args.before], runs[args.after]):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
