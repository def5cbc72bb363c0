"""Issue 44's bound: the decision audit must not slow routing. Route p50/p99 with kvctl's own decisions audited
and without, and the cost of auditing one Dynamo frontend decision (its blocks found by sequence hash, every
candidate priced, judged, kept), on an index of 1M and 10M (worker, block) pairs.

The index holds route_bench's workload (16 workers; 1024-token system prompts shared, unique 1024-token
suffixes); each request is a system prompt and a fresh suffix, with 64 requests in flight (booked on routing,
freed 64 later), so every decision walks a real partial hit and prices the active-block term. "Off" replaces the
fleet's hook with a no-op in the same process (kvctl has no switch for it: the audit is always on), so both sides
share the index, the loads and the machine. A frontend decision is fed as its replica sync's AddRequest is
(`Auditor.peer`), judged before booking. kvctl's own decisions are judged after the route, untimed, as the daemon
judges each on its loop's next turn (`Auditor.soon`): `own_judged_us` is that cost per decision. As in the daemon,
the collector runs with `runtime.survivors_frozen`, and the audit's ring is full before anything is timed (a
growing ring is a warm-up: every verdict it keeps is a survivor for the young collections). Medians and p99 of
`--requests` decisions per figure, in-process.

    python benchmarks/audit_bench.py [--pairs 1000000 10000000] [--requests 2000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from route_bench import BLOCK, SUFFIX_TOKENS, _tokens, populated_router  # noqa: E402

from kvctl.core.audit.ledger import RING  # noqa: E402
from kvctl.core.events.plane import ActiveSequenceEvent, AddRequest  # noqa: E402
from kvctl.core.hashing import local_block_hashes, sequence_hashes  # noqa: E402
from kvctl.runtime import survivors_frozen  # noqa: E402
from kvctl.server.state import Fleet  # noqa: E402
from kvctl.server.worker_info import WorkerInfo  # noqa: E402

WORKERS = 16
IN_FLIGHT = 64


def fleet_of(pairs: int) -> tuple[Fleet, list[list[int]]]:
    router, prompts = populated_router(WORKERS, pairs)
    fleet = Fleet(block_size=BLOCK, seed=1)
    for w in range(WORKERS):
        fleet.register(WorkerInfo(w, 0, "default"))
    fleet.model("default").router.index = router.index
    return fleet, prompts


def quantiles(samples: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(samples, n=100)
    return {"p50_us": round(cuts[49] * 1e6, 1), "p99_us": round(cuts[98] * 1e6, 1)}


def route_times(fleet: Fleet, prompts: list[list[int]], requests: int, seed: int,
                judging: list[float] | None = None) -> list[float]:
    """Each route's time; after each, the audit judges its decision, untimed, as the daemon's loop does on its next
    turn: `judging` gets the time per decision judged."""
    rng = random.Random(seed)
    times, booked = [], []
    for n in range(requests + IN_FLIGHT):
        tokens = prompts[rng.randrange(len(prompts))] + _tokens(rng, SUFFIX_TOKENS)
        started = time.perf_counter()
        fleet.route("default", now=float(n), token_ids=tokens, request_id=f"r{seed}-{n}", reserve=True)
        elapsed = time.perf_counter() - started
        booked.append(f"r{seed}-{n}")
        if len(booked) > IN_FLIGHT:
            fleet.free("default", booked.pop(0))
        if n >= IN_FLIGHT:
            times.append(elapsed)
        if judging is not None:
            started = time.perf_counter()
            fleet.audit.flush()
            judging.append(time.perf_counter() - started)
    for request_id in booked:
        fleet.free("default", request_id)
    return times


def peer_times(fleet: Fleet, prompts: list[list[int]], requests: int) -> tuple[list[float], dict[str, int]]:
    rng = random.Random(99)
    times, reasons = [], {}
    for n in range(requests):
        seq = sequence_hashes(local_block_hashes(prompts[rng.randrange(len(prompts))]
                                                 + _tokens(rng, SUFFIX_TOKENS), BLOCK))
        add = AddRequest(seq, True, None, None)
        event = ActiveSequenceEvent(f"peer-{n}", rng.randrange(WORKERS), 0, add, 7)
        started = time.perf_counter()
        verdict = fleet.audit.peer(event, add, "default", {}, float(n))
        times.append(time.perf_counter() - started)
        assert verdict is not None
        reasons[verdict.why.value] = reasons.get(verdict.why.value, 0) + 1
    return times, reasons


def measure(pairs: int, requests: int) -> dict[str, Any]:
    built = time.perf_counter()
    fleet, prompts = fleet_of(pairs)
    row: dict[str, Any] = {"pairs": fleet.model("default").router.index.device.blocks,
                           "build_s": round(time.perf_counter() - built, 1)}
    own = fleet.audit.own
    on, off, judging = [], [], []
    with survivors_frozen():
        route_times(fleet, prompts, RING, seed=99, judging=[])  # the ring full, as in a router that has routed
        for rnd in range(3):  # alternated, so drift falls on both
            on += route_times(fleet, prompts, requests // 3, seed=2 * rnd, judging=judging)
            fleet.audit.own = lambda *args, **kwargs: None  # type: ignore[method-assign, assignment, return-value]
            off += route_times(fleet, prompts, requests // 3, seed=2 * rnd + 1)
            fleet.audit.own = own  # type: ignore[method-assign]
    row["route_audit_on"], row["route_audit_off"] = quantiles(on), quantiles(off)
    row["route_p50_ratio"] = round(row["route_audit_on"]["p50_us"] / row["route_audit_off"]["p50_us"], 3)
    row["route_p99_ratio"] = round(row["route_audit_on"]["p99_us"] / row["route_audit_off"]["p99_us"], 3)
    row["own_judged_us"] = round(statistics.median(judging) * 1e6, 1)
    peer, reasons = peer_times(fleet, prompts, requests)
    row["peer_audit"] = quantiles(peer)
    row["peer_reasons"] = reasons
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--requests", type=int, default=2_000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    for pairs in args.pairs:
        row = measure(pairs, args.requests)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
