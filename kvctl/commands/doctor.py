"""`kvctl doctor`: the checks an expert runs when KV-aware routing goes wrong, in one command.

Each finding names a cause, the numbers behind it and the next command; the exit code is Nagios'
(0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN), so a monitoring system can run it as a check. An
unreachable router is a CRITICAL finding, not a usage error: it is the first thing doctor diagnoses.
"""

from __future__ import annotations

import json
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
)
from kvctl.output import Column, View

if TYPE_CHECKING:
    from kvctl.client.tier_sources import Auth

HELP = ("Diagnose a router: silent workers, lost events, block-size and hashing mismatches, busy fleets, "
        "diverging replicas, index health; names the cause and the next command. (read-only)")
EXAMPLES = (
    "Examples:\n\n"
    "  kvctl doctor\n\n"
    "  kvctl doctor --server http://router-a:7433 --peer http://router-b:7433\n\n"
    "  kvctl doctor -o json | jq '.findings[] | select(.severity != \"OK\")'\n\n"
    "Exit codes: 0 OK, 1 WARNING, 2 CRITICAL (an unreachable router too), 3 UNKNOWN."
)


def _evidence(finding: dict[str, Any]) -> str:
    return json.dumps(finding["evidence"], separators=(",", ":"))


_VIEW = View(
    rows=lambda report: [{**f, "evidence_text": _evidence(f)} for f in report["findings"]],
    name_key="check",
    columns=[Column("severity", "severity"), Column("check", "check"), Column("cause", "cause"),
             Column("next", "next_step"), Column("evidence", "evidence_text", wide_only=True)],
)


def doctor_command(
    ctx: typer.Context,
    peer: Annotated[list[str] | None, typer.Option(
        "--peer", show_default=False, help="Another replica to compare indexes with (repeatable).")] = None,
    model: Annotated[str | None, typer.Option(
        "--model", "-m", show_default=False, help="Check this model's workers only.")] = None,
    silent_after: Annotated[float, typer.Option(
        "--silent-after", min=0, help="Seconds without events before a worker counts as silent.")] = 60.0,
    divergence: Annotated[float, typer.Option(
        "--divergence", min=0, max=1, help="Share of blocks replicas may differ by (events in flight).")] = 0.01,
    metrics: Annotated[list[str] | None, typer.Option(
        "--metrics", show_default=False,
        help="An engine's /metrics (repeatable): compare its prefix-cache hit rate with the router's "
             "prediction.")] = None,
    auth_user: MetricsUserOpt = None,
    auth_password: MetricsPasswordOpt = None,
    bearer_token: MetricsTokenOpt = None,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
) -> None:
    from kvctl.core.doctor import Finding, Limits, Severity, diagnose, worst
    from kvctl.errors import Unreachable
    from kvctl.exit_codes import CheckStatus

    out = output_for(ctx, output, as_json)
    url = settings_for(ctx).server
    limits = Limits(silent_after_s=silent_after, divergence_share=divergence)
    try:
        status, workers, thresholds = _gather(ctx, model)
    except Unreachable as exc:
        findings = [Finding("router", Severity.CRITICAL, f"router unreachable at {url}", {"error": exc.message},
                            f"is `kvctl serve` running there? (--server / KVCTL_SERVER); curl {url}/healthz")]
    else:
        diffs, unreachable = _peers(ctx, peer or [])
        from kvctl.client.tier_sources import Auth

        engines_auth = Auth(auth_user, auth_password, bearer_token)
        hit_rates = _hit_rates(ctx, metrics, engines_auth) if metrics else None
        findings = [*diagnose(status, workers, thresholds, diffs, limits, hit_rates), *unreachable]
    status = worst(findings)
    report = {"server": url, "status": status.name, "findings": [f.as_dict() for f in findings]}
    out.emit(report, _VIEW)
    counts = {s: sum(f.severity is s for f in findings) for s in Severity}
    out.note(f"doctor: {status.name} (" + ", ".join(f"{n} {s.name.lower()}" for s, n in counts.items() if n) + ")")
    raise typer.Exit(CheckStatus(int(status)))


def _gather(ctx: typer.Context, model: str | None) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """The router's own view: status, workers, busy thresholds (restricted to `model` when given)."""
    from kvctl.client import calls

    with router_client(ctx) as client:
        status = client.send(calls.status())
        workers = client.send(calls.workers())["workers"]
        thresholds = client.send(calls.busy_thresholds())["thresholds"]
    if model is not None:
        workers = [w for w in workers if w["model"] == model]
        status = {**status, "models": {m: s for m, s in status.get("models", {}).items() if m == model}}
        thresholds = [t for t in thresholds if t["model"] == model]
    return status, workers, thresholds


def _peers(ctx: typer.Context, urls: list[str]) -> tuple[list[Any], list[Any]]:
    """Each peer's index diffed against this router's (one dump of this router, one per peer), and a
    WARNING finding for each peer that cannot be reached."""
    if not urls:
        return [], []
    from kvctl.client import sources
    from kvctl.core.doctor import Finding, PeerDiff, Severity
    from kvctl.core.tree_diff import diff_events
    from kvctl.errors import Unreachable

    settings = settings_for(ctx)
    mine = sources.router_events(settings.server.rstrip("/"), model=None, token=settings.token,
                                 timeout=settings.timeout)
    diffs, unreachable = [], []
    for url in urls:
        try:
            theirs = sources.router_events(url.rstrip("/"), model=None, token=settings.token,
                                           timeout=settings.timeout)
        except Unreachable as exc:
            unreachable.append(Finding("divergence", Severity.WARNING, f"peer {url} unreachable: not compared",
                                       {"peer": url, "error": exc.message}, f"curl {url}/healthz"))
            continue
        summary = diff_events(mine, theirs).summary()
        blocks = max(sum(w["blocks_a"] for w in summary), sum(w["blocks_b"] for w in summary))
        differing = sum(w["only_a"] + w["only_b"] for w in summary)
        diffs.append(PeerDiff(url, settings.server, blocks, differing, summary))
    return diffs, unreachable


def _hit_rates(ctx: typer.Context, urls: list[str], engines_auth: Auth) -> list[Any]:
    """Engines' device prefix-cache hit rates and the router's mean predicted hit rate, since each started."""
    from kvctl.client.tier_sources import Auth, Scraper
    from kvctl.core.doctor import Finding, Severity, check_hit_rates
    from kvctl.core.tiers import hit_rates, report
    from kvctl.errors import KvctlError

    settings = settings_for(ctx)
    router = settings.server.rstrip("/") + "/metrics"
    try:  # the router's token goes to the router only, never to the engines
        with Scraper([router], auth=Auth(token=settings.token), timeout=settings.timeout) as own, \
                Scraper(urls, auth=engines_auth, timeout=settings.timeout) as theirs:
            mine, engines = report(own.since_start()), report(theirs.since_start())
    except KvctlError as exc:
        return [Finding("hit_rate", Severity.UNKNOWN, f"metrics not read: {exc.message}", {},
                        "kvctl tiers --metrics URL  (is each engine's /metrics reachable?)")]
    predicted = [r.value for r in mine.readings if r.metric == "predicted_hit_rate"]
    return check_hit_rates({r.instance: r.value for r in hit_rates(engines, "device") if r.value is not None},
                           predicted[0] if predicted else None)

