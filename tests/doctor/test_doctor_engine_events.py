"""Doctor on what engines publish that Dynamo 1.6.1 does not index (issue 43), from `/v1/status` rows as the router
writes them: each drop named by cause, never an OK while a publishing engine's events are all dropped, and the
engines' hashing blamed only where nothing in their configuration explains it. The same findings on the real
vLLM 0.34 / SGLang 0.5.23 streams are checked in tests/interop/test_engine_streams_dynamo.py."""

from __future__ import annotations

from typing import Any

from kvctl.core.doctor import Limits, Severity, check_silent
from kvctl.core.doctor.checks import check_hashing, diagnose
from kvctl.core.doctor.engine_events import check_engine_events


def stream(worker_id: int, dp_rank: int = 0, *, events: int = 10, messages: int = 10, dropped: dict[str, int] | None
           = None, groups: list[dict[str, Any]] | None = None, salts: int = 0, **schema: list[Any]) -> dict[str, Any]:
    return {"worker": {"worker_id": worker_id, "dp_rank": dp_rank}, "events": events, "messages": messages,
            "events_dropped": dropped or {}, "groups": groups or [], "salts_seen": salts,
            "schema": {"dp_ranks": [dp_rank], **schema}}


def group(idx: int, kind: str | None, dropped: int = 0) -> dict[str, Any]:
    return {"dp_rank": 0, "group_idx": idx, "kind": kind, "sliding_window": None, "block_size": 16,
            "events_kept": 5, "events_dropped": dropped}


def worker(worker_id: int, dp_rank: int = 0, *, age: float | None = 1.0, **fields: Any) -> dict[str, Any]:
    return {"worker_id": worker_id, "dp_rank": dp_rank, "model": "default", "last_event_age_s": age, "blocks": 0,
            "routes": 0, "active_requests": 0, **fields}


def by_check(findings: list[Any], check: str) -> Any:
    [finding] = [f for f in findings if f.check == check]
    return finding


def test_an_engine_whose_every_event_is_dropped_is_critical_not_quiet() -> None:
    status = {"streams": [stream(1, events=0, dropped={"block_size_mismatch": 7}), stream(2)]}
    finding = by_check(check_engine_events(status), "dropped")
    assert finding.severity is Severity.CRITICAL and finding.evidence["emptied"] == ["1:0"]
    assert "block_size_mismatch 7" in finding.cause and "--block-size" in finding.next_step


def test_drops_the_engines_meant_indexed_warn_and_by_design_ones_are_named_ok() -> None:
    faults = by_check(check_engine_events({"streams": [stream(1, dropped={"short_tokens": 2})]}), "dropped")
    assert faults.severity is Severity.WARNING and "short_tokens 2" in faults.cause
    design = by_check(check_engine_events({"streams": [stream(1, dropped={
        "non_local_locality": 3, "unsupported_ownership": 1, "non_main_attention_group": 12})]}), "dropped")
    assert design.severity is Severity.OK and "non_main_attention_group 12" in design.cause
    assert check_engine_events({"streams": [stream(1)]}) == []  # nothing dropped: nothing to say


def test_a_hybrid_model_is_named_and_unnamed_groups_warn() -> None:
    hybrid = by_check(check_engine_events({"streams": [stream(1, groups=[
        group(0, "full_attention"), group(1, "sliding_window", dropped=12)])]}), "groups")
    assert hybrid.severity is Severity.OK and "hybrid model" in hybrid.cause
    unnamed = by_check(check_engine_events({"streams": [stream(1, groups=[group(0, None), group(1, None)])]}),
                       "groups")
    assert unnamed.severity is Severity.WARNING and "group 0 is indexed whatever it is" in unnamed.cause


def test_salts_and_eagle_pairs_are_named() -> None:
    findings = check_engine_events({"streams": [stream(1, salts=2), stream(2, token_shapes=["pairs"])]})
    assert by_check(findings, "salts").severity is Severity.OK and "--cache-salt" in by_check(findings, "salts").cause
    assert by_check(findings, "eagle").evidence["workers"] == ["2:0"]


def test_an_engine_publishing_under_an_undeclared_dp_rank_is_named_not_silent() -> None:
    """Registered as 7:0, the engine publishes as rank 1 (SGLang's attn_dp_rank): indexed under 7:1, as Dynamo does."""
    status = {"streams": [{**stream(7), "schema": {"dp_ranks": [1]}}]}
    [finding] = check_silent(status, [worker(7, age=None)], Limits())
    assert finding.severity is Severity.WARNING and finding.evidence["ranks_published"] == {"7:0": [1]}
    assert "serve --worker 7:RANK=" in finding.next_step


def test_hashing_is_not_blamed_where_the_engines_configuration_explains_it() -> None:
    mismatched = [worker(1, hash_mismatches=19, hash_agreements=0), worker(2, hash_agreements=4)]
    [blamed] = check_hashing(mismatched, {"streams": [stream(1), stream(2)]})
    assert blamed.severity is Severity.CRITICAL
    [explained] = check_hashing(mismatched, {"streams": [stream(1, token_shapes=["ids", "lookahead"]), stream(2)]})
    assert explained.severity is Severity.WARNING and "lookahead" in explained.evidence["why"]["1:0"]
    assert "non-deterministic" not in explained.cause


def test_doctor_is_never_ok_with_an_empty_index_while_engines_publish() -> None:
    status = {"streams": [stream(1, events=0, dropped={"non_main_attention_kind": 4, "unknown_kind": 2})],
              "models": {"default": {"blocks": 0, "nodes": 0, "block_size": 16}}}
    findings = diagnose(status, [worker(1)], [])
    assert max(f.severity for f in findings) is Severity.CRITICAL
    assert by_check(findings, "dropped").severity is Severity.CRITICAL
