"""The frame model with no Textual: rates from counter increases, marks, shares, sorting and filtering, and the
routing audit's line."""

from __future__ import annotations

import dataclasses
import io
import json
from typing import Any

import pytest

from kvctl.client.tier_sources import parse_metrics
from kvctl.core.doctor import Limits, check_silent
from kvctl.core.doctor.routing_audit import MIN_DECISIONS
from kvctl.core.silence import SILENT_AFTER_S
from kvctl.output import Output, OutputFormat
from kvctl.tui.frame import SORTS, Frame, FrameBuilder, Mark, RoutingAudit, arrange, next_sort
from kvctl.tui.poll import EVENTS, PREDICTED_COUNT, PREDICTED_SUM, ROUTES, Poll, router_counters
from kvctl.tui.sources import NO_AUDIT
from kvctl.tui.views import audit_is_poor, audit_line, emit_frame, worker_cells
from tests.tui.fake import LOOKED_AT, AuditState, fleet


def _worker(worker_id: int, **fields: Any) -> dict[str, Any]:
    return {"worker_id": worker_id, "dp_rank": 0, "model": "default", "blocks": 10, "active_decode_blocks": 0,
            "active_prefill_tokens": 0, "busy": False, "last_event_age_s": 1.0, **fields}


def _poll(at: float, counters: dict[str, float], workers: list[dict[str, Any]] | None = None,
          streams: list[dict[str, Any]] | None = None) -> Poll:
    status = {"models": {"default": {"blocks": 30, "nodes": 3}}, "streams": streams or []}
    return Poll(at=at, status=status, workers=workers or [_worker(1)], counters=counters)


def test_rates_are_counter_increases_over_the_time_between_polls_and_a_restart_counts_from_zero() -> None:
    builder = FrameBuilder("http://router")
    first = builder.update(_poll(10.0, {EVENTS: 100, ROUTES: 10, PREDICTED_SUM: 2.0, PREDICTED_COUNT: 4}))
    assert (first.header.events_per_s, first.header.routes_per_s, first.header.predicted_hit_rate) == (None,) * 3
    second = builder.update(_poll(12.0, {EVENTS: 300, ROUTES: 30, PREDICTED_SUM: 17.0, PREDICTED_COUNT: 24}))
    assert second.header.events_per_s == 100.0
    assert second.header.routes_per_s == 10.0
    assert second.header.predicted_hit_rate == pytest.approx(0.75)  # 15 / 20 over the interval, not 17 / 24
    restarted = builder.update(_poll(14.0, {EVENTS: 50, ROUTES: 4, PREDICTED_SUM: 0.0, PREDICTED_COUNT: 0}))
    assert restarted.header.events_per_s == 25.0
    assert restarted.header.predicted_hit_rate is None  # nothing routed since the restart
    assert restarted.history["events_per_s"] == (100.0, 25.0)


def test_router_counters_sum_the_routers_metrics_over_models_and_outcomes() -> None:
    text = (
        "# TYPE kvctl_kv_events_applied counter\n"
        'kvctl_kv_events_applied_total{model="a",event_type="stored",status="ok"} 7\n'
        'kvctl_kv_events_applied_total{model="b",event_type="removed",status="block_not_found"} 2\n'
        "# TYPE kvctl_route_duration_seconds histogram\n"
        'kvctl_route_duration_seconds_bucket{model="a",le="+Inf"} 5\n'
        'kvctl_route_duration_seconds_count{model="a"} 5\n'
        'kvctl_route_duration_seconds_sum{model="a"} 0.01\n'
    )
    assert router_counters(parse_metrics(text)) == {EVENTS: 9.0, ROUTES: 5.0, PREDICTED_SUM: 0.0, PREDICTED_COUNT: 0.0}


def test_marks_name_busy_gapped_and_silent_workers() -> None:
    workers = [_worker(1), _worker(2, busy=True), _worker(3), _worker(4, last_event_age_s=SILENT_AFTER_S),
               _worker(5, last_event_age_s=None)]
    streams = [{"worker": {"worker_id": 3, "dp_rank": 0}, "gaps": 1, "gapped": True, "messages": 9,
                "decode_errors": {"a": 2, "b": 1}}]
    frame = FrameBuilder("r").update(_poll(0.0, {}, workers, streams))
    marks = {w.worker_id: w.marks for w in frame.workers}
    assert marks == {1: (), 2: (Mark.busy,), 3: (Mark.gapped,), 4: (Mark.silent,), 5: (Mark.silent,)}
    three = next(w for w in frame.workers if w.worker_id == 3)
    assert (three.gaps, three.decode_errors) == (1, 3)
    assert next(w for w in frame.workers if w.worker_id == 1).gaps is None  # no engine stream
    assert frame.health.by_state == {"gapped": 1}


def test_top_and_doctor_call_a_worker_silent_at_the_same_age() -> None:
    ages = {1: 1.0, 2: 45.0, 3: SILENT_AFTER_S - 0.01, 4: SILENT_AFTER_S, 5: SILENT_AFTER_S + 30.0, 6: None}
    workers = [_worker(worker_id, last_event_age_s=age) for worker_id, age in ages.items()]
    frame = FrameBuilder("r").update(_poll(0.0, {}, workers))
    in_top = {f"{w.worker_id}:0" for w in frame.workers if Mark.silent in w.marks}
    [finding] = check_silent({"models": {}, "streams": []}, workers, Limits())
    assert set(finding.evidence["workers"]) == in_top == {"4:0", "5:0", "6:0"}


def test_a_decode_worker_silent_by_design_is_shown_with_its_role_and_not_marked() -> None:
    """A disaggregated fleet's decode workers publish no KV events (their cards say so): top names their pool and
    does not mark them silent, as doctor does not; a prefill worker that stopped publishing is still marked."""
    workers = [_worker(1, role="prefill", publishes_kv_events=True, last_event_age_s=None),
               _worker(2, role="decode", publishes_kv_events=False, last_event_age_s=None), _worker(3)]
    frame = FrameBuilder("r").update(_poll(0.0, {}, workers))
    assert {w.worker_id: w.marks for w in frame.workers} == {1: (Mark.silent,), 2: (), 3: ()}
    assert [worker_cells(w)["model"] for w in frame.workers] == ["default (prefill)", "default (decode)", "default"]
    assert [w.to_dict()["role"] for w in frame.workers] == ["prefill", "decode", None]


def test_share_of_routes_is_of_the_routes_decided_since_the_previous_poll() -> None:
    builder = FrameBuilder("r")
    builder.update(_poll(0.0, {}, [_worker(1, routes=100), _worker(2, routes=0), _worker(3)]))
    frame = builder.update(_poll(1.0, {}, [_worker(1, routes=130), _worker(2, routes=10), _worker(3)]))
    assert {w.worker_id: w.route_share for w in frame.workers} == {1: 0.75, 2: 0.25, 3: None}


def test_sorts_cycle_and_keep_unknown_values_last_and_ties_in_worker_order() -> None:
    rows = FrameBuilder("r").update(_poll(0.0, {}, [
        _worker(3, blocks=5), _worker(1, blocks=9), _worker(2, blocks=9, last_event_age_s=None)])).workers
    by_blocks = next_sort(SORTS[0])
    assert [r.worker_id for r in arrange(rows, SORTS[0])] == [1, 2, 3]
    assert [r.worker_id for r in arrange(rows, by_blocks)] == [1, 2, 3]
    last_event = next(s for s in SORTS if s.field == "last_event_age_s")
    assert [r.worker_id for r in arrange(rows, last_event)] == [1, 3, 2]
    sort = SORTS[0]
    for _ in SORTS:
        sort = next_sort(sort)
    assert sort == SORTS[0]


def test_filter_finds_worker_names_models_and_marks() -> None:
    rows = FrameBuilder("r").update(fleet(16)(0)).workers
    assert {r.key for r in arrange(rows, SORTS[0], "101:")} == {"101:0", "101:1"}
    assert {r.model for r in arrange(rows, SORTS[0], "QWEN")} == {"qwen"}
    assert all(Mark.silent in r.marks for r in arrange(rows, SORTS[0], "silent"))
    assert arrange(rows, SORTS[0], "silent")
    assert arrange(rows, SORTS[0], "nothing-like-this") == []


def test_a_poll_survives_its_json_line() -> None:
    poll = fleet(4, tiers=True)(3)
    assert Poll.from_json(poll.to_json()) == poll


# ----- the routing audit line (GET /v1/audit): figures, an empty window, a router without the audit -----------

def _audit_frame(state: AuditState) -> Frame:
    return FrameBuilder("r").update(fleet(4, audit=state)(0))


def test_the_audit_line_reads_the_windows_figures() -> None:
    frame = _audit_frame("figures")
    assert frame.audit is not None and frame.audit_note is None
    assert audit_line(frame.audit) == (
        "routing (5 min): 83% of 46 decisions with cache to find went to a worker holding the most · avoidable "
        "prefill 7% (1,536 tokens) · kvctl agrees 100% (16 ties) · top reasons: load_balance 8")
    assert not audit_is_poor(frame.audit)
    shown = frame.to_dict()
    assert shown["audit"]["optimal_share"] == pytest.approx(38 / 46) and shown["audit_note"] is None
    assert set(shown["audit"]) == {"window_s", "decisions", "cached_decisions", "optimal_share",
                                   "avoidable_prefill_tokens", "cacheable_prefill_tokens", "avoidable_share",
                                   "agreement", "agreement_share", "reasons", "looked_at"}


def test_an_empty_window_says_what_it_looked_at_in_short() -> None:
    frame = _audit_frame("empty")
    assert frame.audit is not None and frame.audit.decisions == 0
    assert audit_line(frame.audit) == ("routing (5 min): no decision heard in the last 300 s (12 since start); "
                                       "kvctl audit says where it listens")
    assert frame.to_dict()["audit"]["looked_at"] == LOOKED_AT  # -o json keeps it whole


def test_a_router_without_the_audit_is_a_note_and_a_recording_without_it_says_nothing() -> None:
    missing = _audit_frame("missing")
    assert missing.audit is None and missing.audit_note == NO_AUDIT
    assert (missing.to_dict()["audit"], missing.to_dict()["audit_note"]) == (None, NO_AUDIT)
    old = json.loads(fleet(4)(0).to_json())  # a recording made before top polled the audit
    del old["audit"], old["audit_note"]
    unpolled = FrameBuilder("r").update(Poll.from_json(json.dumps(old)))
    assert (unpolled.audit, unpolled.audit_note) == (None, None)


def test_the_audit_line_without_cache_to_find_with_disagreements_and_poor_routing() -> None:
    base = RoutingAudit.of(fleet(4)(0).audit or {})
    none_cached = dataclasses.replace(base, cached_decisions=0, optimal_share=None, avoidable_share=None,
                                      avoidable_prefill_tokens=0, agreement_share=None, reasons={})
    assert audit_line(none_cached) == ("routing (5 min): 50 decisions, none with cache to find · avoidable prefill "
                                       "0 tokens")
    poor = dataclasses.replace(base, window_s=60.0, cached_decisions=4210, optimal_share=0.31,
                               agreement={"agree": 3000, "tie": 1, "disagree": 1209, "unknown": 0},
                               agreement_share=0.71, reasons={"load_balance": 2000, "busy": 900, "tie": 5,
                                                              "index_behind": 1})
    assert audit_line(poor) == (
        "routing (1 min): 31% of 4,210 decisions with cache to find went to a worker holding the most · avoidable "
        "prefill 7% (1,536 tokens) · kvctl agrees 71% (1 tie, 1,209 not) · top reasons: load_balance 2,000, "
        "busy 900, tie 5")
    assert audit_is_poor(poor)
    assert not audit_is_poor(dataclasses.replace(poor, cached_decisions=MIN_DECISIONS - 1))  # too few to judge


@pytest.mark.parametrize("state", ["figures", "empty", "missing", "unpolled"])
def test_once_prints_the_audit_as_a_table_a_note_or_nothing(state: AuditState) -> None:
    stdout, stderr = io.StringIO(), io.StringIO()
    emit_frame(Output(stdout=stdout, stderr=stderr, color=False), _audit_frame(state))
    printed, said = stdout.getvalue(), stderr.getvalue()
    assert ("routing audit" in printed) == (state in ("figures", "empty"))
    if state == "figures":
        assert "routing (5 min)" in printed and "83% of 46 decisions" in printed
        assert "load_balance 8" in printed and "1,536 tokens" in printed
    if state == "empty":
        assert "no decision heard in the last 300 s (12 since start)" in printed
    assert said == (f"routing audit: {NO_AUDIT}\n" if state == "missing" else "")
    stdout = io.StringIO()
    emit_frame(Output(format=OutputFormat.json, stdout=stdout, stderr=io.StringIO()), _audit_frame(state))
    answer = json.loads(stdout.getvalue())
    assert (answer["audit"] is not None) == (state in ("figures", "empty"))
    assert answer["audit_note"] == (NO_AUDIT if state == "missing" else None)
