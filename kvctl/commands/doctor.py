"""`kvctl doctor`: the checks an expert runs when KV-aware routing goes wrong, in one command.

Each finding names a cause, the numbers behind it and the next command; the exit code is Nagios'
(0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN), so a monitoring system can run it as a check (`-o nagios` prints the
plugin's status line first). An unreachable router is a CRITICAL finding, not an error: it is the first thing
doctor diagnoses; an error that stops the check itself (a bad option) is UNKNOWN (`kvctl.cli.CHECKS`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvctl.commands._options import (
    CheckOutputOpt,
    JsonOpt,
    MetricsPasswordOpt,
    MetricsTokenOpt,
    MetricsUserOpt,
    metrics_window,
    output_for,
    router_client,
    settings_for,
)
from kvctl.commands._watch import IntervalOpt, WatchOpt, show
from kvctl.core.doctor import (
    SHOWN,
    Finding,
    Limits,
    PeerDiff,
    Severity,
    check_hit_rates,
    diagnose,
    differing_workers,
    worst,
)
from kvctl.core.doctor.routing_audit import check_routing, check_self_reports, self_report
from kvctl.core.silence import SILENT_AFTER_S
from kvctl.errors import UsageError
from kvctl.output import Column, Output, OutputFormat, View

if TYPE_CHECKING:
    from kvctl.client import RouterClient
    from kvctl.client.tier_sources import Auth

HELP = ("Diagnose a router: silent workers, lost events, block-size and hashing mismatches, busy fleets, "
        "diverging replicas, index health; names the cause and the next command. (read-only)")
EXAMPLES = (
    "Examples:\n\n"
    "  kvctl doctor\n\n"
    "  kvctl doctor --server http://router-a:7433 --peer http://router-b:7433\n\n"
    "  kvctl doctor -o json | jq '.findings[] | select(.severity != \"OK\")'\n\n"
    "  kvctl doctor --watch --interval 10\n\n"
    "  kvctl doctor --server http://router:7433 -o nagios   # a Nagios, Icinga or NRPE check\n\n"
    "--timeout bounds the whole check (every call to the router, its peers and the engines together). "
    "-o nagios prints a monitoring plugin's output: one status line with perfdata, then one line per finding "
    "(docs/checks.md).\n\n"
    "Exit codes: 0 OK, 1 WARNING, 2 CRITICAL (an unreachable router too, or one not answering in time), "
    "3 UNKNOWN (a check that could not run: a bad option or --server too). --watch checks again every --interval "
    "seconds until Ctrl-C, which exits 0."
)


def _evidence(finding: dict[str, Any]) -> str:
    return json.dumps(finding["evidence"], separators=(",", ":"))


_VIEW = View(
    rows=lambda report: [{**f, "evidence_text": _evidence(f)} for f in report["findings"]],
    name_key="check",
    columns=[Column("severity", "severity"), Column("check", "check"), Column("cause", "cause"),
             Column("next", "next_step"), Column("evidence", "evidence_text", wide_only=True)],
    wrap=True,
)


def doctor_command(
    ctx: typer.Context,
    peer: Annotated[list[str] | None, typer.Option(
        "--peer", show_default=False, help="Another replica to compare indexes with (repeatable).")] = None,
    model: Annotated[str | None, typer.Option(
        "--model", "-m", show_default=False, help="Check this model's workers only.")] = None,
    silent_after: Annotated[float, typer.Option(
        "--silent-after", min=0,
        help="Seconds without events before a worker counts as silent (kvctl top uses the default).")] = SILENT_AFTER_S,
    divergence: Annotated[float, typer.Option(
        "--divergence", min=0, max=1, help="Share of blocks replicas may differ by (events in flight).")] = 0.01,
    unreachable_after: Annotated[float, typer.Option(
        "--unreachable-after", min=0, help="Dynamo's ZMQ event plane: seconds a publisher found in discovery may "
                                           "stay unconnected before it counts as unreachable.")] = 10.0,
    metrics: Annotated[list[str] | None, typer.Option(
        "--metrics", show_default=False,
        help="An engine's /metrics (repeatable): compare its prefix-cache hit rate with the router's "
             "prediction.")] = None,
    prometheus: Annotated[str | None, typer.Option(
        "--prometheus", show_default=False,
        help="A Prometheus scraping the engines, instead of --metrics: their hit rates over --window. "
             "Only when given here (a configured one is not used implicitly).")] = None,
    window: Annotated[str, typer.Option("--window", help="With --prometheus: over how long (30s, 5m, 1h).")] = "5m",
    auth_user: MetricsUserOpt = None,
    auth_password: MetricsPasswordOpt = None,
    bearer_token: MetricsTokenOpt = None,
    watch: WatchOpt = False,
    interval: IntervalOpt = 5.0,
    output: CheckOutputOpt = None,
    as_json: JsonOpt = False,
) -> None:
    from kvctl.client.deadline import within
    from kvctl.exit_codes import CheckStatus

    out = output_for(ctx, output, as_json, check=True)
    if watch and out.format is OutputFormat.nagios:
        raise UsageError("-o nagios checks once; it does not go with --watch",
                         hint="let the monitoring system run the check each interval")
    window_s = metrics_window(metrics, prometheus, window)
    settings = settings_for(ctx)
    limits = Limits(silent_after_s=silent_after, divergence_share=divergence, unreachable_after_s=unreachable_after)
    previous: list[Finding] = []  # the last round's, with --watch: the loop check's hysteresis reads them

    def check() -> list[Finding]:
        with within(settings.timeout):  # a check's whole run, not each call: what Nagios' own timeout expects
            gathered = _gather(ctx, model)
            if isinstance(gathered, Finding):
                findings = [gathered]
            else:
                status, workers, thresholds, audit = gathered
                diffs, not_compared = _peers(ctx, peer or [], status.get("models", {}), model)
                from kvctl.client.tier_sources import Auth

                engines = _Engines(metrics or [], prometheus, window_s, Auth(auth_user, auth_password, bearer_token))
                hit_rates, reported = _hit_rates(ctx, engines) if metrics or prometheus else (None, None)
                routing = [*check_routing(audit, None if reported is None else self_report(reported)),
                           *check_self_reports(audit, reported)]
                findings = [*diagnose(status, workers, thresholds, diffs, limits, hit_rates, previous, routing),
                            *not_compared]
        previous[:] = findings
        return findings

    def report(findings: list[Finding]) -> dict[str, Any]:
        return {"server": settings.server, "status": worst(findings).name, "findings": [f.as_dict() for f in findings]}

    if watch:  # for a person watching a fleet: Ctrl-C ends it with 0, as every --watch does
        show(out, check, lambda findings: _render(out, report(findings)), watch=True, interval=interval)
        return
    findings = check()
    if out.format is OutputFormat.nagios:
        from kvctl.core.doctor.plugin import doctor_check

        out.line(doctor_check(findings, limits))
    else:
        _render(out, report(findings))
    raise typer.Exit(CheckStatus[worst(findings).name])


def _render(out: Output, report: dict[str, Any]) -> None:
    """The findings, then the verdict and its counts on stderr."""
    out.emit(report, _VIEW)
    counts = {s: sum(f["severity"] == s.name for f in report["findings"]) for s in Severity}
    out.note(f"doctor: {report['status']} (" + ", ".join(f"{n} {s.name.lower()}" for s, n in counts.items() if n)
             + ")")


@dataclass(frozen=True)
class _Engines:
    """Where the engines' prefix-cache hit rates come from: their /metrics (since each started) or a Prometheus."""

    metrics: list[str]
    prometheus: str | None
    window_s: float
    auth: Auth


Gathered = tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]], dict[str, Any] | None]


def _gather(ctx: typer.Context, model: str | None) -> Gathered | Finding:
    """The router's own view: status, workers, busy thresholds and its decision audit of the last 5 minutes (None
    from a router without one), restricted to `model` when given; or, when the router cannot be asked, the finding
    that says so: CRITICAL when nothing answers (or not in time), UNKNOWN
    when something answers with an error (not a kvctl router, or one that refuses doctor's questions). The core's
    checks read them as the JSON they are (`kvctl.core` knows nothing of `kvctl.http_api`)."""
    import msgspec

    from kvctl.client import calls
    from kvctl.errors import ApiError, KvctlError

    url = settings_for(ctx).server
    try:
        with router_client(ctx) as client:
            status = client.send(calls.status())
            workers = client.send(calls.workers()).workers
            thresholds = client.send(calls.busy_thresholds()).thresholds
            audit = _audit(client, model)
    except ApiError as exc:
        return Finding("router", Severity.UNKNOWN, f"the router at {url} answered with an error: cannot diagnose it",
                       {"error": exc.message, "http_status": exc.status},
                       f"is {url} a kvctl router (not an engine or a frontend)? curl {url}/v1/status")
    except KvctlError as exc:
        return Finding("router", Severity.CRITICAL, f"router unreachable at {url}", {"error": exc.message},
                       f"is `kvctl serve` running there? (--server / KVCTL_SERVER); curl {url}/healthz")
    if model is not None:
        if model not in status.models:  # Nagios: a check asked about nothing it can see is UNKNOWN
            models = sorted(status.models)
            return Finding("router", Severity.UNKNOWN, f"the router at {url} has no model {model!r}",
                           {"models": models}, f"pick one with --model: {', '.join(models) or 'none'}")
        workers = [w for w in workers if w.model == model]
        status = msgspec.structs.replace(status, models={m: s for m, s in status.models.items() if m == model})
        thresholds = [t for t in thresholds if t.model == model]
    return msgspec.to_builtins(status), msgspec.to_builtins(workers), msgspec.to_builtins(thresholds), audit


def _peers(ctx: typer.Context, urls: list[str], mine: dict[str, Any],
           model: str | None) -> tuple[list[PeerDiff], list[Finding]]:
    """Each peer compared with this router (`mine`: its status' models), and a WARNING finding for each peer
    that could not be read."""
    import msgspec

    from kvctl.client import RouterClient, calls
    from kvctl.errors import KvctlError

    settings = settings_for(ctx)
    diffs, not_compared = [], []
    with router_client(ctx) as own:
        for url in urls:
            try:
                with RouterClient(url.rstrip("/"), token=settings.token, timeout=settings.timeout) as peer:
                    theirs = {m: msgspec.to_builtins(s) for m, s in peer.send(calls.status()).models.items()
                              if model in (None, m)}
                    rows = _compare(own, peer, mine, theirs)
            except KvctlError as exc:
                not_compared.append(Finding("divergence", Severity.WARNING, f"peer {url} not compared: {exc.message}",
                                            {"peer": url, "error": exc.message}, f"curl {url}/v1/status"))
                continue
            blocks = max(sum(m.get("blocks", 0) for m in models.values()) for models in (mine, theirs))
            diffs.append(PeerDiff(url, settings.server, blocks, sum(r["only_a"] + r["only_b"] for r in rows), rows))
    return diffs, not_compared


def _compare(own: RouterClient, peer: RouterClient, mine: dict[str, Any],
             theirs: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-worker block counts first; then the blocks themselves of up to SHOWN workers whose counts differ
    (both routers' parts of the index, diffed by path); the other differing workers count by their difference
    in blocks, marked estimated. Reading only the differing workers keeps a 1M-block comparison in seconds."""
    from kvctl.client import calls
    from kvctl.core.events.dynamo import decode_router_event_json
    from kvctl.core.tree_diff import diff_events

    rows: list[dict[str, Any]] = []
    for n, (model, worker, here, there) in enumerate(differing_workers(mine, theirs)):
        if n >= SHOWN:
            rows.append({"model": model, "worker": worker, "blocks_a": here, "blocks_b": there,
                         "only_a": max(0, here - there), "only_b": max(0, there - here), "estimated": True})
            continue
        a, b = ([decode_router_event_json(e) for e in client.send(calls.tree(model, worker))] for client in (own, peer))
        rows += [{**row, "model": model} for row in diff_events(a, b).summary()]
    return rows


def _audit(client: RouterClient, model: str | None) -> dict[str, Any] | None:
    """The router's decision audit of the last 5 minutes; None from a router without one (before issue 44), or
    that has no such model (the model check says so)."""
    import msgspec

    from kvctl.client import calls
    from kvctl.errors import NotFound

    try:
        return msgspec.to_builtins(client.send(calls.audit(300.0, model)))
    except NotFound:
        return None


def _hit_rates(ctx: typer.Context, engines: _Engines
               ) -> tuple[list[Finding], dict[tuple[str, str], dict[str, float]] | None]:
    """Engines' device prefix-cache hit rates and the router's mean predicted hit rate since it started; and a
    Dynamo frontend's router queue and its own decision counters per router (None where the metrics were not read).

    An engine without a prefix-cache family of its own (Dynamo's mocker) counts by what a Dynamo frontend among
    the metrics says its engines reported cached (`cached_share`). The prediction is kvctl's own when it has
    routed; else a Dynamo router's among the metrics (its kv_hit_rate histogram: Σ sum / Σ count)."""
    from kvctl.client.tier_sources import Auth, Scraper, prometheus_windows
    from kvctl.core.doctor.frontend_queue import check_frontend_queue
    from kvctl.core.doctor.routing_audit import self_reports
    from kvctl.core.tiers import hit_rates, ratio, report
    from kvctl.errors import KvctlError

    settings = settings_for(ctx)
    router = settings.server.rstrip("/") + "/metrics"
    try:  # the router's token goes to the router only, never to the engines or Prometheus
        with Scraper([router], auth=Auth(token=settings.token), timeout=settings.timeout) as own:
            mine = report(own.since_start())
        if engines.prometheus is not None:
            windows = prometheus_windows(engines.prometheus.rstrip("/"), window_s=engines.window_s,
                                         auth=engines.auth, timeout=settings.timeout)
        else:
            with Scraper(engines.metrics, auth=engines.auth, timeout=settings.timeout) as scraper:
                windows = scraper.since_start()
    except KvctlError as exc:
        flag = "--prometheus URL" if engines.prometheus is not None else "--metrics URL"
        return [Finding("hit_rate", Severity.UNKNOWN, f"metrics not read: {exc.message}", {},
                        f"kvctl tiers {flag}  (is it reachable? are the engines' families there?)")], None
    theirs = report(windows)
    rates = {r.instance: r.value for r in hit_rates(theirs, "device") if r.value is not None}
    for r in theirs.readings:
        if r.metric == "cached_share" and r.value is not None:
            rates.setdefault(r.instance, r.value)
    predicted, by = None, None
    for source in (mine, theirs):
        found = [r for r in source.readings if r.metric == "predicted_hit_rate" and r.parts is not None]
        predicted = ratio(sum(r.parts[0] for r in found if r.parts), sum(r.parts[1] for r in found if r.parts))
        if predicted is not None:
            by = ", ".join(sorted({r.family for r in found}))
            break
    return [*check_hit_rates(rates, predicted, predicted_by=by), *check_frontend_queue(windows)], self_reports(windows)
