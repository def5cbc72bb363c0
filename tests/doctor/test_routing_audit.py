"""doctor's routing finding, from the decision audit's window and a Dynamo router's own counters."""

from __future__ import annotations

from typing import Any

from kvctl.client.tier_sources import parse_metrics
from kvctl.core.doctor import Severity
from kvctl.core.doctor.routing_audit import check_routing, check_self_reports, self_report, self_reports
from kvctl.core.tiers import Sample, Window
from tests.fixtures_path import FIXTURES


def audit(cached: int = 100, optimal: float | None = 0.95, reasons: dict[str, int] | None = None,
          disagree: int = 0, avoidable: int = 160, decisions: int | None = None) -> dict[str, Any]:
    return {"window_s": 300.0, "decisions": cached if decisions is None else decisions, "cached_decisions": cached,
            "optimal_share": optimal, "avoidable_prefill_tokens": avoidable, "cacheable_prefill_tokens": 16_000,
            "avoidable_share": avoidable / 16_000, "agreement": {"agree": cached - disagree, "tie": 0,
                                                                 "disagree": disagree, "unknown": 0},
            "reasons": reasons or {}, "routers": {"42": cached}, "looked_at": "no decision heard in the last 300 s"}


def test_routing_that_finds_the_cache_is_ok_and_says_how_well() -> None:
    (finding,) = check_routing(audit())
    assert finding.severity is Severity.OK and finding.cause.startswith("95% of 100 decisions with cache to find")


def test_too_few_decisions_or_none_are_ok_and_say_what_was_looked_at() -> None:
    (few,) = check_routing(audit(cached=5))
    (none,) = check_routing(audit(cached=0, decisions=0, optimal=None))
    assert few.severity is none.severity is Severity.OK
    assert "too few to judge" in few.cause and none.cause == "no decision heard in the last 300 s"
    assert check_routing(None) == []  # a router without the audit: nothing said


def test_poor_routing_is_a_warning_naming_the_top_reason_and_what_to_do() -> None:
    (finding,) = check_routing(audit(optimal=0.31, reasons={"load_balance": 60, "tie": 9}, avoidable=6_080))
    assert finding.severity is Severity.WARNING
    assert "31% of 100 decisions" in finding.cause and "38% of cacheable prefill was avoidable" in finding.cause
    assert "top reason: load balance" in finding.cause and "prefill_load_scale" in finding.next_step


def test_a_router_ignoring_the_cache_whose_own_counters_read_zero_is_critical() -> None:
    (finding,) = check_routing(audit(optimal=0.4, reasons={"cache_ignored": 50}),
                               {"best_eligible": 0.0, "selected": 0.0})
    assert finding.severity is Severity.CRITICAL
    assert "own decision counters read 0" in finding.cause and "overlap_score_credit" in finding.next_step
    assert finding.evidence["router_self_report"] == {"best_eligible": 0.0, "selected": 0.0}


def test_a_cost_function_that_disagrees_names_the_knobs() -> None:
    (finding,) = check_routing(audit(disagree=30, reasons={"unexplained": 5}))
    assert finding.severity is Severity.WARNING and "30% of 100 decisions" in finding.cause
    assert "--router-policy-config" in finding.next_step
    (behind,) = check_routing(audit(disagree=30, reasons={"index_behind": 5}))
    assert behind.severity is Severity.OK  # kvctl's index lagged: not the knobs


def test_the_self_report_is_summed_over_series_and_absent_without_the_family() -> None:
    samples = (Sample("dynamo_component_router_kv_best_eligible_cached_prefix_tokens_total", {"phase": "a"}, 64.0),
               Sample("dynamo_component_router_kv_best_eligible_cached_prefix_tokens_total", {"phase": "b"}, 16.0),
               Sample("dynamo_component_router_kv_selected_cached_prefix_tokens_total", {}, 48.0),
               Sample("vllm:prefix_cache_hits_total", {}, 5.0))
    assert self_report(self_reports([Window("f:8000", 60.0, samples)])) == {"best_eligible": 80.0, "selected": 48.0}
    assert self_report(self_reports([Window("e:9000", 60.0, samples[3:])])) is None


# A Dynamo 1.6.1 frontend's own counters after 24 shared-prefix requests: 3,840 cached tokens on the best eligible
# workers, 3,456 on its picks (10 % lost), its decisions counted by its hit-rate histogram.
CAPTURED = self_reports([Window("frontend:8000", 0.0, parse_metrics(
    (FIXTURES / "dynamo-1.6.1-fleet" / "metrics" / "frontend.prom").read_text()))])
ROUTER = "4238352712680185056"


def audited(decisions: int, avoidable: int, cacheable: int = 3_840) -> dict[str, Any]:
    totals = {"model": "tiny", "router": ROUTER, "decisions": decisions, "cacheable_prefill_tokens": cacheable,
              "chosen_prefill_tokens": cacheable - avoidable, "avoidable_prefill_tokens": avoidable}
    return {**audit(), "totals": [totals]}


def test_a_routers_counters_read_per_router_with_its_decisions() -> None:
    assert CAPTURED == {("tiny", ROUTER): {"best_eligible": 3840.0, "selected": 3456.0, "non_max": 0.0,
                                           "decisions": 24.0}}


def test_a_router_and_the_audit_that_count_the_same_loss_over_the_same_decisions_agree() -> None:
    (finding,) = check_self_reports(audited(24, 384), CAPTURED)
    assert finding.severity is Severity.OK
    assert finding.cause == (f"router {ROUTER} (tiny) counts 10% of cacheable prefill lost, the audit 10%, "
                             "over 24 decisions")


def test_a_router_that_counts_far_less_lost_than_the_audit_finds_is_a_warning_saying_which_to_believe() -> None:
    (finding,) = check_self_reports(audited(24, 1_536), CAPTURED)
    assert finding.severity is Severity.WARNING and finding.check == "router_counters"
    assert "counts 10% of cacheable prefill lost, the audit 40%" in finding.cause
    assert "believe the audit if kvctl's streams are whole" in finding.cause and "streams" in finding.next_step
    (less,) = check_self_reports(audited(24, 0, cacheable=960), CAPTURED)  # kvctl's index holds less cache
    assert less.severity is Severity.WARNING and "believe the router's counters" in less.cause


def test_counters_over_other_decisions_than_the_audits_are_not_compared_and_say_why() -> None:
    (finding,) = check_self_reports(audited(10, 1_536), CAPTURED)  # kvctl started after the frontend
    assert finding.severity is Severity.OK
    assert finding.cause == (f"not compared: router {ROUTER} (tiny): 10 of its 24 decisions audited (each counts "
                             "since it started)")
    blind = {key: {**figures, "best_eligible": 0.0, "selected": 0.0} for key, figures in CAPTURED.items()}
    (unpriced,) = check_self_reports(audited(24, 1_536), blind)  # the routing finding names a blind router
    assert unpriced.severity is Severity.OK and "counts no cacheable prefill in its 24 decisions" in unpriced.cause
    assert check_self_reports(audited(24, 0), {}) == [] and check_self_reports(None, CAPTURED) == []
