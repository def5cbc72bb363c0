"""`kvctl audit`: is KV-aware routing working? Every decision a router heard, judged against its index.

A window's summary (the share of decisions with cache to find that went to the worker holding the most, the
prefill that was avoidable, how often kvctl's cost function agrees, the reasons for the rest, by worker), or
one decision explained with its candidates as they were (`--request`). Decisions are heard from kvctl's own
`/v1/route` and from a Dynamo frontend's replica sync (docs/audit.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvctl.commands._options import (
    JsonOpt,
    MetricsPasswordOpt,
    MetricsTokenOpt,
    MetricsUserOpt,
    OutputOpt,
    output_for,
    router_client,
    settings_for,
    window_seconds,
)
from kvctl.commands._watch import IntervalOpt, WatchOpt, show
from kvctl.core.words import counted
from kvctl.output import Column, Output, View

if TYPE_CHECKING:
    from kvctl.client.tier_sources import Auth

HELP = "Judge a router's routing decisions against its index: optimal share, avoidable prefill, why. (read-only)"
EXAMPLES = (
    "Examples:\n\n"
    "  kvctl audit\n\n"
    "  kvctl audit --window 1h --model llama -o json | jq .optimal_share\n\n"
    "  kvctl audit --request 9f1c2e4a-5b6d-4e7f-8a9b-0c1d2e3f4a5b\n\n"
    "  kvctl audit --recent 20 -o wide --watch\n\n"
    "  kvctl audit --window 1h --what-if overlap_score_credit=2 --what-if prefill_load_scale=0.5\n\n"
    "  kvctl audit --metrics http://frontend:8000/metrics"
)

_WORKER_COLUMNS = [
    Column("worker", "worker"),
    Column("decisions", "decisions", justify="right"),
    Column("optimal", "optimal", justify="right"),
    Column("suboptimal", "suboptimal", justify="right"),
    Column("unknown", "unknown", justify="right"),
    Column("avoidable tokens", "avoidable_tokens", justify="right"),
]
_DECISION_COLUMNS = [
    Column("request", "request_id"),
    Column("router", "router"),
    Column("age", "age", justify="right"),
    Column("worker", "worker"),
    Column("cached/best", "cached", justify="right"),
    Column("outcome", "outcome"),
    Column("reason", "reason"),
    Column("agreement", "agreement"),
    Column("avoidable", "avoidable_tokens", justify="right"),
    Column("kvctl picks", "picks", wide_only=True),
]
_CANDIDATE_COLUMNS = [
    Column("worker", "worker"),
    Column("device blocks", "overlap_blocks", justify="right"),
    Column("cached blocks", "cached_blocks", justify="right"),
    Column("weighted", "weighted_blocks", justify="right"),
    Column("logit", "logit", justify="right"),
    Column("busy", "busy"),
    Column("", "mark"),
]


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def summary_title(answer: dict[str, Any]) -> str:
    """The window in one paragraph: what a person at 3 a.m. reads first."""
    if not answer["decisions"]:
        return answer["looked_at"] + _self_report(answer.get("self_report"))
    outcomes, agreement = answer["outcomes"], answer["agreement"]
    reasons = ", ".join(f"{why} {n}" for why, n in list(answer["reasons"].items())[:3]) or "none"
    return (f"last {answer['window_s']:g} s: {answer['decisions']} decisions, {answer['cached_decisions']} with "
            f"cache to find; {_share(answer['optimal_share'])} of those went to a worker holding the most "
            f"({outcomes['suboptimal']} did not, {outcomes['unknown']} unknown); avoidable prefill "
            f"{answer['avoidable_prefill_tokens']:,} of {answer['cacheable_prefill_tokens']:,} cached tokens "
            f"({_share(answer['avoidable_share'])}); kvctl's cost function agrees on "
            f"{_share(answer['agreement_share'])} ({agreement['tie']} ties, {agreement['disagree']} not); "
            f"reasons: {reasons}" + _what_if(answer.get("what_if")) + _self_report(answer.get("self_report")))


def _what_if(figures: dict[str, Any] | None) -> str:
    if not figures:
        return ""
    knobs = " ".join(f"{k}={v}" for k, v in figures["knobs"].items())
    return (f". What if {knobs}: {figures['changed']} of {figures['decisions']} picks would change; optimal "
            f"{_share(figures['optimal_share'])} -> {_share(figures['optimal_share_then'])}; avoidable prefill "
            f"{figures['avoidable_prefill_tokens']:,} -> {figures['avoidable_prefill_tokens_then']:,} tokens "
            "(each decision as it was; later loads and caches not followed)")


def _summary_rows(answer: dict[str, Any]) -> list[dict[str, Any]]:
    if answer["recent"]:
        return [_decision_row(d) for d in answer["recent"]]
    return [{**w, "worker": f"{w['worker_id']}:{w['dp_rank']}"} for w in answer["workers"]]


def _decision_row(d: dict[str, Any]) -> dict[str, Any]:
    return {**d, "worker": f"{d['worker_id']}:{d['dp_rank']}", "age": f"{d['age_s']:.0f}s",
            "cached": f"{d['chosen_overlap']}/{d['best_overlap']}", "picks": " ".join(d["kvctl_picks"])}


def _candidate_rows(d: dict[str, Any]) -> list[dict[str, Any]]:
    picked = f"{d['worker_id']}:{d['dp_rank']}"
    rows = []
    for c in d["candidates"]:
        worker = f"{c['worker_id']}:{c['dp_rank']}"
        marks = [m for m, on in (("picked", worker == picked), ("most cache", worker in d["optimal"]),
                                 ("kvctl's pick", worker in d["kvctl_picks"])) if on]
        rows.append({**c, "worker": worker, "weighted_blocks": f"{c['weighted_blocks']:g}",
                     "logit": f"{c['logit']:.3f}", "mark": ", ".join(marks)})
    return rows


_AGREEMENT = {"agree": "picks the same", "tie": "prices it among equals", "disagree": "picks another",
              "unknown": "cannot price it"}


def decision_title(d: dict[str, Any]) -> str:
    seen = f" ({d['unresolved']})" if d["unresolved"] else ""
    credited = "" if d["router_overlap"] is None else f"; the router saw {d['router_overlap']:g} cached blocks on it"
    stale = "" if not d["stale"] else "; not caught up: " + ", ".join(f"{w} {why}" for w, why in d["stale"].items())
    return (f"request {d['request_id']} ({d['model']}, router {d['router']}, {d['age_s']:.0f} s ago): picked "
            f"{d['worker_id']}:{d['dp_rank']} holding {d['chosen_overlap']} of {d['blocks']} blocks, the most any "
            f"held {d['best_overlap']}: {d['outcome']}, {d['reason']}{seen}; kvctl {_AGREEMENT[d['agreement']]}; "
            f"avoidable {counted(d['avoidable_tokens'], 'token')}{credited}{stale}")


def audit_command(
    ctx: typer.Context,
    window: Annotated[str, typer.Option("--window", help="How far back: 30s, 5m, 1h.")] = "5m",
    model: Annotated[str | None, typer.Option("--model", "-m", help="Only this model's decisions.",
                                              show_default=False)] = None,
    request: Annotated[str | None, typer.Option("--request", "-r", help="Explain one recent decision by its "
                                                "request id.", show_default=False)] = None,
    recent: Annotated[int, typer.Option("--recent", min=0, max=1000, help="List the window's last N decisions "
                                        "instead of the per-worker rows.")] = 0,
    metrics: Annotated[list[str] | None, typer.Option(
        "--metrics", show_default=False, metavar="URL",
        help="A Dynamo frontend's /metrics (repeatable): its own decision counters beside kvctl's audit of the "
             "same router, both since each started.")] = None,
    what_if: Annotated[list[str] | None, typer.Option(
        "--what-if", show_default=False, metavar="KNOB=VALUE",
        help="Price the window's decisions again under this knob (repeatable; Dynamo names: overlap_score_credit, "
             "prefill_load_scale, ...): how many picks would change, and the avoidable prefill then.")] = None,
    auth_user: MetricsUserOpt = None,
    auth_password: MetricsPasswordOpt = None,
    bearer_token: MetricsTokenOpt = None,
    watch: WatchOpt = False,
    interval: IntervalOpt = 2.0,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
) -> None:
    from kvctl.client import calls
    from kvctl.client.tier_sources import Auth
    from kvctl.core.audit.what_if import parse_knobs
    from kvctl.errors import UsageError

    out = output_for(ctx, output, as_json)
    seconds = window_seconds(window)
    try:
        parse_knobs(what_if or ())
    except ValueError as exc:
        raise UsageError(f"--what-if: {exc}", hint="e.g. --what-if overlap_score_credit=0.5") from None
    with router_client(ctx) as client:
        if request is not None:
            one = View(rows=_candidate_rows, columns=_CANDIDATE_COLUMNS, name_key="worker", wrap=True)
            show(out, lambda: client.send(calls.audited_decision(request)),
                 lambda d: _emit(out, d, one, decision_title), watch=watch, interval=interval)
            return
        view = View(rows=_summary_rows, columns=_DECISION_COLUMNS if recent else _WORKER_COLUMNS,
                    name_key="request_id" if recent else "worker", wrap=True)

        def fetch() -> dict[str, Any]:
            import msgspec

            answer = msgspec.to_builtins(client.send(calls.audit(seconds, model, recent, what_if)))
            if metrics:
                answer["self_report"] = _beside(answer["totals"], metrics, Auth(auth_user, auth_password, bearer_token),
                                                settings_for(ctx).timeout)
            return answer

        show(out, fetch, lambda answer: _emit(out, answer, view, summary_title), watch=watch, interval=interval)


def _beside(totals: list[dict[str, Any]], urls: list[str], auth: Auth, timeout: float) -> list[dict[str, Any]]:
    """Each Dynamo router's own decision counters among the metrics, beside kvctl's audit of the same router."""
    from kvctl.client.tier_sources import Scraper
    from kvctl.core.doctor.routing_audit import audited_by_router, self_reports

    with Scraper(urls, auth=auth, timeout=timeout) as scraper:
        reports = self_reports(scraper.since_start())
    audited = audited_by_router(totals)
    return [{"model": model, "router": router, "dynamo": figures, "kvctl": audited.get(router)}
            for (model, router), figures in sorted(reports.items())]


def _self_report(rows: list[dict[str, Any]] | None) -> str:
    """The routers' own words beside the audit's, since each started (their starts may differ: compare rates with
    --watch, or over a window in Prometheus)."""
    if rows is None:
        return ""
    if not rows:
        return ". The metrics given export no Dynamo router decision counters"
    parts = []
    for row in rows:
        dyn, mine = row["dynamo"], row["kvctl"]
        best, selected = int(dyn.get("best_eligible", 0)), int(dyn.get("selected", 0))
        said = (f"router {row['router']} ({row['model']}) counts {int(dyn.get('decisions', 0)):,} decisions, best "
                f"eligible {best:,}, selected {selected:,} cached tokens (lost {best - selected:,}), non-max "
                f"selections {int(dyn.get('non_max', 0)):,}")
        heard = "; kvctl heard none of its decisions" if mine is None else (
            f"; kvctl audited {mine['decisions']:,} of its decisions: best {mine['cacheable_prefill_tokens']:,}, "
            f"chosen {mine['chosen_prefill_tokens']:,} (avoidable {mine['avoidable_prefill_tokens']:,})")
        parts.append(said + heard)
    return ". Beside the routers' own counters (each since it started): " + "; ".join(parts)


def _emit(out: Output, answer: Any, view: View, title: Callable[[dict[str, Any]], str]) -> None:
    """The answer in the view, titled from the answer itself."""
    import msgspec

    data = msgspec.to_builtins(answer)
    out.emit(data, dataclasses.replace(view, title=title(data)))
