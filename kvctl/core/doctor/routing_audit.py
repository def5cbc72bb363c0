"""Is KV-aware routing working? The decision audit's window (`GET /v1/audit`, docs/audit.md) read as a finding, beside
the router's own decision counters where a Dynamo frontend's metrics were given (`doctor --metrics`).

The router's self-report goes blind exactly when it matters: a Dynamo 1.6.1 frontend with overlap credit 0 takes no
KV events, so its best-eligible and selected cached-token counters read 0 while it routes past the cache. The audit
judges each decision from kvctl's own index, so it says which to believe.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from kvctl.core.doctor.findings import Finding, Severity
from kvctl.core.tiers import DYNAMO_DECISIONS, DYNAMO_PREDICTED, Window
from kvctl.core.words import counted

MIN_DECISIONS = 20
"""Decisions with cache to find, at least, before the share is judged: a handful says nothing."""
OPTIMAL_FLOOR = 0.7
"""Under this share of decisions to a worker holding the most cache, routing is poor (WARNING)."""
DISAGREE_CEILING = 0.1
"""Over this share of decisions where kvctl's cost function picks another worker (not for its index being behind),
the router's knobs are not kvctl's."""
SAME_DECISIONS = 0.05
"""A router's own counters and kvctl's audit of it are compared only where they count the same decisions, within this
share: each is since its own start, and a kvctl started later has heard fewer."""
LOSS_GAP = 0.08
"""Over this gap between the share of cacheable prefill a router counts as lost and the share the audit finds, over
the same decisions, their indexes disagree (WARNING). Over a live 1.6.1 fleet's 48 decisions the two were equal; a
decision priced on an index a few events apart moves the share by a few points."""

_NEXT = {
    "cache_ignored": "the router gives cached blocks no credit: set overlap_score_credit above 0 (the policy file's "
                     "default-cost-fn parameters, or --router-kv-overlap-score-credit)",
    "load_balance": "load outweighs the cache under the router's knobs: compare prefill_load_scale and "
                    "overlap_score_credit with the fleet's needs; add capacity if workers are saturated",
    "busy": "the workers holding the cache were busy: kvctl busy get; add capacity or raise the thresholds",
    "index_behind": "kvctl's index lags the router's: kvctl doctor's streams and event_plane findings",
    "sampled": "the router samples its picks (router_temperature > 0): lower it for more cache hits",
    "tie": "ties between workers of equal cost: nothing to fix",
    "unexplained": "kvctl's knobs may not be the frontend's: start kvctl serve with the frontend's "
                   "--router-policy-config, then kvctl audit --recent 20",
}


_SHORT = {"kv_best_eligible_cached_prefix_tokens": "best_eligible", "kv_selected_cached_prefix_tokens": "selected",
          "non_max_overlap_selections": "non_max"}


SelfReports = Mapping[tuple[str, str], Mapping[str, float]]
"""A Dynamo router's own decision counters per (model, router id) (`self_reports`)."""


def self_report(by_router: SelfReports) -> dict[str, float] | None:
    """The routers' own decision counters summed over every router; None when none exports them."""
    if not by_router:
        return None
    totals: Counter[str] = Counter()
    for figures in by_router.values():
        totals.update(figures)
    return dict(totals)


def self_reports(windows: Sequence[Window]) -> dict[tuple[str, str], dict[str, float]]:
    """A Dynamo router's own decision counters among the metrics (best eligible and selected cached prefix tokens,
    non-max selections, and its decisions: its hit-rate histogram's count) per (model, router id), as their labels
    name them, since each started: those without a model label in 1.6.1 go with their router's one model ("?" where
    it has none, or several). Only routers that export the decision counters are kept."""
    found: dict[tuple[str, str], dict[str, float]] = {}
    for window in windows:
        for sample in window.samples:
            if (m := DYNAMO_DECISIONS.pattern.fullmatch(sample.name)) is not None:
                name = _SHORT[m[1]]
            elif (m := DYNAMO_PREDICTED.pattern.fullmatch(sample.name)) is not None and m[1] == "count":
                name = "decisions"
            else:
                continue
            key = (sample.labels.get("model", "?"), sample.labels.get("router_id", "?"))
            figures = found.setdefault(key, {})
            figures[name] = figures.get(name, 0.0) + sample.value
    for router in [r for m, r in found if m == "?"]:  # a router's unlabelled series: its one model's
        models = [m for m, r in found if r == router and m != "?"]
        if len(models) == 1:
            for name, value in found.pop(("?", router)).items():
                found[models[0], router][name] = found[models[0], router].get(name, 0.0) + value
    return {key: figures for key, figures in found.items() if figures.keys() - {"decisions"}}


_AUDITED = ("decisions", "cacheable_prefill_tokens", "chosen_prefill_tokens", "avoidable_prefill_tokens")


def audited_by_router(totals: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """The audit's totals (`GET /v1/audit`'s) per router id, their models summed: a router id is its own (random at
    each start), and kvctl may name a model its own way (the implicit `default`), so routers are matched by id."""
    audited: dict[str, Counter[str]] = {}
    for row in totals:
        audited.setdefault(row["router"], Counter()).update({key: row[key] for key in _AUDITED})
    return {router: dict(summed) for router, summed in audited.items()}


def check_self_reports(audit: Mapping[str, Any] | None, reports: SelfReports | None) -> list[Finding]:
    """Each router's own count of cacheable prefill lost beside the audit's, where both count the same decisions
    (`audit["totals"]` and `reports` are each since their own start): the router prices its picks with its index,
    the audit with kvctl's, so a gap says one of the two indexes is not the engines'. Routers are matched by id
    (`audited_by_router`)."""
    if audit is None or not reports:
        return []
    audited = audited_by_router(audit.get("totals", []))
    by_router: dict[str, tuple[list[str], Counter[str]]] = {}
    for (model, router), figures in sorted(reports.items()):
        models, summed = by_router.setdefault(router, ([], Counter()))
        models.append(model)
        summed.update(figures)
    compared: list[tuple[str, float, float]] = []
    gaps: list[tuple[str, float, float]] = []
    apart: list[str] = []
    for router, (models, figures) in by_router.items():
        mine = audited.get(router)
        theirs = int(figures.get("decisions", 0))
        name = f"router {router} ({', '.join(models)})"
        if mine is None or not theirs or abs(mine["decisions"] - theirs) > SAME_DECISIONS * theirs:
            heard = 0 if mine is None else mine["decisions"]
            apart.append(f"{name}: {heard:,} of its {theirs:,} decisions audited (each counts since it started)")
            continue
        best, selected = figures.get("best_eligible", 0.0), figures.get("selected", 0.0)
        if not best:  # a router blind to the cache: the routing finding says so
            apart.append(f"{name} counts no cacheable prefill in its {theirs:,} decisions")
            continue
        lost = (best - selected) / best
        cacheable = mine["cacheable_prefill_tokens"]
        found = mine["avoidable_prefill_tokens"] / cacheable if cacheable else 0.0
        said = f"{name} counts {lost:.0%} of cacheable prefill lost, the audit {found:.0%}, over {theirs:,} decisions"
        (gaps if abs(lost - found) > LOSS_GAP and theirs >= MIN_DECISIONS else compared).append((said, lost, found))
    evidence: dict[str, Any] = {"compared": [s for s, _, _ in compared + gaps], "not_compared": apart}
    if gaps:
        said, lost, found = gaps[0]
        why = ("the router sees less of the cache it passed by than kvctl's index holds: believe the audit if "
               "kvctl's streams are whole (the streams and event_plane findings OK), else the router" if found > lost
               else "kvctl's index holds less cache than the router's: believe the router's counters until kvctl's "
                    "streams are whole (the streams and event_plane findings)")
        return [Finding("router_counters", Severity.WARNING, f"{said}: their indexes disagree; {why}", evidence,
                        "kvctl doctor -o wide (streams, event_plane); kvctl audit --recent 20 -o wide")]
    if compared:
        return [Finding("router_counters", Severity.OK, "; ".join(s for s, _, _ in compared), evidence)]
    return [Finding("router_counters", Severity.OK, "not compared: " + "; ".join(apart), evidence)]


def check_routing(audit: Mapping[str, Any] | None, reported: Mapping[str, float] | None = None) -> list[Finding]:
    """`audit`: the router's `/v1/audit` answer (None from a router without the audit); `reported`: `self_report`."""
    if audit is None:
        return []
    window = f"{audit['window_s'] / 60:g} min"
    cached, share = audit["cached_decisions"], audit["optimal_share"]
    evidence = {k: audit[k] for k in ("decisions", "cached_decisions", "optimal_share", "avoidable_prefill_tokens",
                                      "cacheable_prefill_tokens", "avoidable_share", "agreement", "reasons",
                                      "routers")}
    if reported is not None:
        evidence["router_self_report"] = reported
    if cached < MIN_DECISIONS:
        said = audit["looked_at"] if not audit["decisions"] else \
            f"{counted(cached, 'decision')} with cache to find in the last {window}: too few to judge"
        return [Finding("routing", Severity.OK, said, evidence)]
    reasons: dict[str, int] = audit["reasons"]
    top = next(iter(reasons), None)
    avoidable = audit["avoidable_share"] or 0.0
    blind = reported is not None and not reported.get("best_eligible") and not reported.get("selected") \
        and audit["avoidable_prefill_tokens"] > 0
    said = (f"{share:.0%} of {cached:,} decisions with cache to find in the last {window} went to a worker holding "
            f"the most; {avoidable:.0%} of cacheable prefill was avoidable"
            + (f"; top reason: {top.replace('_', ' ')}" if top else ""))
    if blind:
        said += ("; the router's own decision counters read 0 (a Dynamo router with overlap credit 0 takes no KV "
                 "events, so it sees no cache to lose): believe the audit, which reads kvctl's index")
    if share < OPTIMAL_FLOOR or blind:
        severity = Severity.CRITICAL if top == "cache_ignored" or blind else Severity.WARNING
        return [Finding("routing", severity, said, evidence,
                        f"kvctl audit --recent 20; {_NEXT.get(top or '', 'kvctl audit --request ID')}")]
    agreement = audit["agreement"]
    compared = agreement["agree"] + agreement["tie"] + agreement["disagree"]
    if compared and agreement["disagree"] / compared > DISAGREE_CEILING and top != "index_behind":
        return [Finding("routing", Severity.WARNING,
                        f"kvctl's cost function picks another worker than the router on "
                        f"{agreement['disagree'] / compared:.0%} of {compared:,} decisions: " + said, evidence,
                        "kvctl audit --recent 20 -o wide; " + _NEXT["unexplained"])]
    return [Finding("routing", Severity.OK, said, evidence)]
