"""The 60-second soak (benchmarks/soak.py, whose full run is ten minutes a phase): a real `kvctl serve` under
steady engine churn with routes alongside, then an approximate-mode router filled past its cap.

Rates are what this suite's 2-core CI machine sustains beside everything the soak starts (router, route
client, engines): 5,000 events/s in steps of 100 events and 100 routes/s, not the full run's 50,000 and
1,000. What must hold is the same: RSS flat once the engines' caches are full, the node count flat under
churn, route p99 as good at the end as after warm-up, every event applied (no gap, loss, decode error or
drop), and the approximate router never over its cap.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


@pytest.mark.slow
def test_a_minute_of_churn_and_routing_keeps_memory_nodes_latency_and_every_event() -> None:
    args = ["--duration", "30", "--window", "5", "--events-per-s", "5000", "--routes-per-s", "100",
            "--engines", "8", "--slots", "1000", "--max-tree-size", "20000"]
    run = subprocess.run([sys.executable, str(SOAK), *args], cwd=SOAK.parent, capture_output=True, text=True,
                         timeout=150)
    lines = run.stdout.strip().splitlines()
    summary = json.loads(lines[-1]) if lines else {}
    assert "summary" in summary, f"exit {run.returncode}: {run.stderr[-3000:]}"
    events, approximate = summary["summary"]
    print(json.dumps(summary, indent=1))
    assert events["checks"] == {"rss_bounded": True, "p99_stable": True, "routes_answered": True,
                                "nodes_flat": True, "nothing_lost": True}, events
    assert events["loss"] == {"gaps": 0, "lost_batches": 0, "decode_errors": 0, "dropped_batches": 0}
    assert events["pairs_held"] == events["pairs_expected"] > 8 * 1000
    assert events["events_per_s_achieved"] >= 0.8 * 5000, events  # the load really ran
    assert approximate["checks"]["under_cap"] and approximate["pairs_end"] > 0.5 * 20000, approximate
    assert all(approximate["checks"].values()), approximate
    assert run.returncode == 0
