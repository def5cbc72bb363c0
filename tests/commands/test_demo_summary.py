"""The lines under the demo's table: the verdict in numbers, and an explanation whenever the router's capacity
comes out below random placement's (a reader must never be left to conclude that routing slows serving)."""

from __future__ import annotations

import copy
from typing import Any

from kvctl.commands.demo import phase_rows, summary


def _step(concurrency: int, per_s: float) -> dict[str, Any]:
    return {"concurrency": concurrency, "requests_per_s": per_s, "ttft_p90_ms": 90.0, "met_slo": True,
            "hit_rate": 0.5, "ttft_p50_ms": 60.0, "ttft_p99_ms": 120.0, "e2e_p50_ms": 300.0, "duration_s": 2.0}


def _open(policy: str, hit: float, p90: float) -> dict[str, Any]:
    return {"policy": policy, "hit_rate": hit, "requests_per_s": 12.0, "goodput_per_s": 12.0, "offered_per_s": 12.8,
            "ttft_p90_ms": p90, "ttft_p99_ms": p90 * 1.5, "e2e_p50_ms": 300.0, "duration_s": 15.0, "errors": {},
            "router_calls_ms": {"route": {"p50": 4.7, "p99": 13.1, "count": 180}} if policy == "router" else {},
            "route_decision_ms": {"p50": 0.37, "p99": 0.77},
            "cpu_cores": {"load generator": 0.18, "engines": 0.11, "router": 0.08}}


RESULT = {
    "router_url": "http://127.0.0.1:1", "engines": 4, "timing": "Dynamo mocker polynomial: ...", "ttft_slo_ms": 300.0,
    "offered_per_s": 12.8, "hit_rate_gain_points": 27.0,
    "capacity": {"random": {"policy": "random", "duration_s": 12.0, "best": _step(8, 18.3), "steps": []},
                 "router": {"policy": "router", "duration_s": 14.0, "best": _step(16, 26.9), "steps": []}},
    "open_loop": {"random": _open("random", 0.39, 102.0), "router": _open("router", 0.66, 71.8)},
}


def test_rows_are_each_policy_at_capacity_then_at_the_offered_rate() -> None:
    rows = phase_rows(RESULT)
    assert [(r["phase"], r["policy"]) for r in rows] == [("capacity", "random"), ("capacity", "router"),
                                                         ("open-loop", "random"), ("open-loop", "router")]
    assert rows[1]["requests_per_s"] == 26.9 and rows[3]["offered_per_s"] == 12.8


def test_the_verdict_names_both_policies_numbers_and_what_the_router_cost() -> None:
    lines = summary(RESULT)
    assert "timing: Dynamo mocker polynomial" in lines[0]
    assert "TTFT p90 102 -> 71.8 ms" in lines[1] and "+27.0 points" in lines[1]
    assert lines[2].endswith("random 18.3 req/s (8 in flight), router 26.9 req/s (16 in flight)")
    assert "route p50 4.7 / p99 13.1 ms" in lines[3] and "route decision p50 0.37" in lines[3]
    assert "load generator 0.18, engines 0.11, router 0.08" in lines[4]


def test_a_router_capacity_below_randoms_comes_with_its_cause_in_numbers() -> None:
    result = copy.deepcopy(RESULT)
    result["capacity"]["router"]["best"] = _step(8, 15.0)
    capacity = summary(result)[2]
    assert "router 15 req/s" in capacity and "the router's is lower here: each request paid its route call (p50 4.7 " \
        "ms)" in capacity
    assert "load generator 0.18, engines 0.11, router 0.08 cores busy" in capacity


def test_a_policy_that_met_the_target_at_no_concurrency_says_so() -> None:
    result = copy.deepcopy(RESULT)
    result["capacity"]["random"]["best"] = None
    assert "random: no concurrency met it (try a larger --ttft-slo)" in summary(result)[2]
    assert "None" not in " ".join(summary(result))
