"""`kvctl tiers`: is each KV tier earning its keep? Hit rates per instance and tier over a window.

The numbers come from Prometheus (`increase()` over --window) or from engines' `/metrics` scraped twice
--window apart. An engine's first scrape already holds its counters since it started, so with --metrics
those figures come at once (`"basis": "since_start"` in -o json: ratios, no rates), and the table follows
with the window's once it has passed, counting down on a terminal. Scripts get one answer: -o json/yaml/name
print the since-start figures and stop, unless --wait asks for the window's; --warn/--crit always judge the
window's, as an alert is about now. Prometheus has the window's at once (`"basis": "window"`).

Each number says which metric family it came from, and families nobody exposes are listed, never guessed;
instances that export no counter of a tier below the device (a Dynamo frontend, the mocker)
are named once, in a note (`no_tier_counters` in -o json), not shown as 0.0 % per tier. With --warn/--crit
(or -o nagios) it is a Nagios check of one tier's hit rate: one status line with perfdata, a line per other
instance, and exit 0 OK / 1 WARNING / 2 CRITICAL / 3 UNKNOWN (no data, the source not reached, or a usage error:
`kvctl.cli.CHECKS`).
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Generator
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
    settings_for,
)
from kvctl.commands._watch import IntervalOpt, WatchOpt, show
from kvctl.errors import KvctlError, UsageError
from kvctl.output import Column, Output, OutputFormat, View

if TYPE_CHECKING:
    from kvctl.client.tier_sources import Auth
    from kvctl.core.tiers import Reading, TierReport, Window

HELP = "KV tier hit rates (device/host/disk/object) per instance, from Prometheus or engines' /metrics. (read-only)"
EXAMPLES = (
    "Examples:\n\n"
    "  kvctl tiers --prometheus http://prometheus:9090 --window 15m\n\n"
    "  kvctl tiers --metrics http://engine-0:8000 --metrics http://engine-1:8000 --window 30s\n\n"
    "  kvctl tiers --metrics http://engine-0:8000 --window 1m --wait -o json   # the window's rates, not "
    "since start\n\n"
    "  kvctl tiers --prometheus http://prometheus:9090 --tier host --warn 0.2 --crit 0.05   # Nagios: exit "
    "0/1/2/3\n\n"
    "  kvctl tiers -o json | jq '.totals[] | select(.metric == \"hit_rate\")'"
)
_BAR_WIDTH = 20
_TIER_ORDER = {tier: n for n, tier in enumerate(("device", "host", "disk", "object", "p2p", "external"))}


def _bar(value: float | None) -> str | None:
    if value is None:
        return None
    filled = round(value * _BAR_WIDTH)
    return "█" * filled + "·" * (_BAR_WIDTH - filled)


def _shown(r: Reading) -> str | None:
    if r.value is None:
        return None
    if r.kind == "ratio":
        return f"{r.value:.1%}"
    return f"{r.value:.4g}/s" if r.kind == "rate" else f"{r.value:g}"


def _rows(report: TierReport) -> list[dict[str, Any]]:
    """Every reading as a table row; the totals only when there is more than one instance to total."""
    totals = report.totals if len(report.instances) > 1 else ()
    readings = sorted(report.readings, key=lambda r: (r.instance, _TIER_ORDER.get(r.tier or "", len(_TIER_ORDER))))
    return [{**r.to_dict(), "name": f"{r.instance}/{r.tier or '-'}/{r.metric}", "value": _shown(r),
             "bar": _bar(r.value) if r.kind == "ratio" else None}
            for r in (*readings, *totals)]


_VIEW = View(
    rows=lambda data: _rows(data),
    columns=[
        Column("instance", "instance"),
        Column("tier", "tier"),
        Column("metric", "metric"),
        Column("value", "value", justify="right"),
        Column("", "bar"),
        Column("family", "family"),
        Column("numerator", "numerator", wide_only=True, justify="right"),
        Column("denominator", "denominator", wide_only=True, justify="right"),
    ],
    name_key="name",
)

TierOpt = Annotated[str, typer.Option("--tier", help="The tier --warn/--crit check: host, disk, object or device.")]


def tiers_command(
    ctx: typer.Context,
    prometheus: Annotated[str | None, typer.Option("--prometheus", show_default=False, help=(
        "Prometheus URL (KVCTL_PROMETHEUS, or the context's `prometheus`).")), ] = None,
    metrics: Annotated[list[str] | None, typer.Option("--metrics", show_default=False, help=(
        "An engine's /metrics URL instead (repeatable): scraped twice, --window apart; the figures since it "
        "started come at once.")), ] = None,
    window: Annotated[str, typer.Option("--window", help="Over how long: 30s, 5m, 1h.")] = "5m",
    instance: Annotated[str | None, typer.Option("--instance", show_default=False,
                                                 help="Only instances this regex finds.")] = None,
    wait: Annotated[bool, typer.Option("--wait", help=(
        "With --metrics: print only the window's figures, after --window. Without it -o json/yaml/name print "
        "the figures since each engine started, at once, and tables show those first, then the window's. "
        "Prometheus has the window's at once.")), ] = False,
    auth_user: MetricsUserOpt = None,
    auth_password: MetricsPasswordOpt = None,
    bearer_token: MetricsTokenOpt = None,
    warn: Annotated[float | None, typer.Option("--warn", show_default=False, min=0.0, max=1.0,
                                               help="WARNING (exit 1) when the tier's hit rate over --window "
                                                    "is below this (with --metrics: after --window).")] = None,
    crit: Annotated[float | None, typer.Option("--crit", show_default=False, min=0.0, max=1.0,
                                               help="CRITICAL (exit 2) when below this.")] = None,
    tier: TierOpt = "host",
    watch: WatchOpt = False,
    interval: IntervalOpt = 5.0,
    output: CheckOutputOpt = None,
    as_json: JsonOpt = False,
) -> None:
    from kvctl.client.tier_sources import Auth
    from kvctl.core.tiers import CHECK_TIERS, Basis, report

    out = output_for(ctx, output, as_json, check=True)
    checking = warn is not None or crit is not None or out.format is OutputFormat.nagios
    _check_options(tier, warn, crit, checking and watch, CHECK_TIERS)
    window_s = metrics_window(metrics, prometheus, window)
    try:
        pattern = re.compile(instance) if instance is not None else None
    except re.error as exc:
        raise UsageError(f"--instance: {exc}") from None
    auth = Auth(auth_user, auth_password, bearer_token)
    tables = out.format in (OutputFormat.table, OutputFormat.wide)

    def source() -> Generator[list[Window]]:
        return _answers(ctx, prometheus, metrics or [], window_s, auth, since_start=not (wait or checking),
                        wait_until=_waiter(out, window))

    answers = source()
    where = _where(settings_for(ctx, prometheus=prometheus).prometheus, metrics or [])
    note, warning = _once(out.note), _once(out.warn)

    def fetch() -> TierReport:
        nonlocal answers
        try:
            windows = next(answers)
        except KvctlError:  # a generator that raised is over: a --watch's next try reads the source afresh
            answers = source()
            raise
        tier_report = report(windows, instance=pattern)
        if not tier_report.instances:
            warning("no instance exposes any of the metric families kvctl reads" if pattern is None
                    else f"no instance matches --instance {instance!r}")
        elif tables:
            if tier_report.untiered_note is not None:  # once, instead of a 0.0 % row per tier
                note(tier_report.untiered_note)
            missing = tier_report.missing_note(where)
            if missing is not None:
                note(missing)
        return tier_report

    def render(data: TierReport) -> None:
        out.emit(data.to_dict() if _structured(out) else data, dataclasses.replace(_VIEW, title=_title(data, window)))

    try:
        if checking:
            _run_check(out, fetch(), tier, warn, crit)  # exits with the check's status
        if watch:
            show(out, fetch, render, watch=True, interval=interval)
            return
        first = fetch()
        render(first)
        if tables and first.basis is Basis.since_start:  # then the window's, once it has passed
            try:
                render(fetch())
            except KeyboardInterrupt:
                out.note("stopped before the window passed: the figures above count since each engine started")
                raise typer.Exit(130) from None
    finally:
        answers.close()


def _where(prometheus: str | None, metrics: list[str]) -> str:
    """Where the families were looked for, in a few words: the one endpoint, how many, or the Prometheus."""
    if len(metrics) == 1:
        return metrics[0]
    return f"the {len(metrics)} --metrics endpoints" if metrics else f"Prometheus {prometheus}"


def _structured(out: Output) -> bool:
    return out.format in (OutputFormat.json, OutputFormat.yaml)


def _title(tier_report: TierReport, window: str) -> str:
    from kvctl.core.tiers import Basis

    if tier_report.basis is Basis.since_start:
        return f"since each engine started (ratios; the rates need --window {window})"
    return f"over the last {window}"


def _once(say: Callable[[str], None]) -> Callable[[str], None]:
    """`say`, but each message only the first time: a table shown twice, or watched, repeats no note."""
    said: set[str] = set()

    def once(message: str) -> None:
        if message not in said:
            said.add(message)
            say(message)
    return once


def _waiter(out: Output, window: str) -> Callable[[float], None]:
    """How the command waits for a window to pass (until a `time.monotonic` moment): a countdown on a terminal's
    stderr under a table, silence everywhere else (-o json above all)."""
    if out.format in (OutputFormat.table, OutputFormat.wide) and out.stderr.isatty():
        return lambda until: _countdown(out, until, window)
    return lambda until: time.sleep(max(0.0, until - time.monotonic()))


def _countdown(out: Output, until: float, window: str) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn

    total = max(until - time.monotonic(), 1e-3)
    columns = (TextColumn(f"measuring the rates over {window}"), BarColumn(),
               TextColumn("{task.fields[left]} left (Ctrl-C stops)"))
    with Progress(*columns, console=Console(file=out.stderr, no_color=not out.color), transient=True) as progress:
        task = progress.add_task("", total=total, left=_duration(total))
        while (left := until - time.monotonic()) > 0:
            progress.update(task, completed=total - left, left=_duration(left))
            time.sleep(min(0.25, left))


def _duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest:02d}s" if minutes else f"{rest}s"


def _check_options(tier: str, warn: float | None, crit: float | None, watching: bool, tiers: tuple[str, ...]) -> None:
    if tier not in tiers:
        raise UsageError(f"--tier must be one of {', '.join(tiers)}, got {tier!r}")
    if warn is not None and crit is not None and crit > warn:
        raise UsageError(f"--crit {crit} is above --warn {warn}", hint="a hit rate below --crit is worse than one "
                         "below --warn: give --crit <= --warn")
    if watching:
        raise UsageError("--warn/--crit and -o nagios check once; they do not go with --watch")


def _answers(ctx: typer.Context, prometheus: str | None, metrics: list[str], window_s: float, auth: Auth, *,
             since_start: bool, wait_until: Callable[[float], None]) -> Generator[list[Window]]:
    """The chosen source's windows (a flag, else the configured Prometheus), each as soon as it is known."""
    settings = settings_for(ctx, prometheus=prometheus)
    if metrics:
        from kvctl.client.tier_sources import Scraper

        with Scraper(metrics, auth=auth, timeout=settings.timeout) as scraper:
            yield from scraper.answers(window_s, since_start=since_start, wait_until=wait_until)
        return
    if settings.prometheus is None:
        raise UsageError("no source to read", hint="give --prometheus URL or --metrics URL (or set KVCTL_PROMETHEUS,"
                         " or `prometheus` in the config context)")
    from kvctl.client.tier_sources import prometheus_windows

    url = settings.prometheus.rstrip("/")
    while True:
        yield prometheus_windows(url, window_s=window_s, auth=auth, timeout=settings.timeout)


def _run_check(out: Output, tier_report: TierReport, tier: str, warn: float | None, crit: float | None) -> None:
    """Print the check (one Nagios line, or the report with its verdict as JSON) and exit with its status."""
    from kvctl.core.tiers import check
    from kvctl.exit_codes import CheckStatus

    result = check(tier_report, tier, warn=warn, crit=crit)
    if _structured(out):
        out.emit({**tier_report.to_dict(), "check": result.to_dict()}, _VIEW)
    else:
        out.line(result.nagios(warn, crit))
    raise typer.Exit(CheckStatus[result.status.value])
