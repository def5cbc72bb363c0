"""Options shared by every command, as `Annotated` aliases so each is declared once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvctl.core.names import WorkerSelector, parse_worker
from kvctl.output import Output, OutputFormat

if TYPE_CHECKING:
    from kvctl.client import RouterClient
    from kvctl.config import Settings

OutputOpt = Annotated[
    OutputFormat | None,
    typer.Option("--output", "-o", help="Output format: table, wide, json, yaml or name.", show_default=False,
                 metavar="FORMAT"),
]
CheckOutputOpt = Annotated[
    OutputFormat | None,
    typer.Option("--output", "-o", help="Output format: table, wide, json, yaml, name, or nagios: a monitoring "
                                        "plugin's status line with perfdata, then one line per finding; exit 0 OK, "
                                        "1 WARNING, 2 CRITICAL, 3 UNKNOWN (docs/checks.md).", show_default=False,
                 metavar="FORMAT"),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Alias for -o json.")]


def output_for(ctx: typer.Context, output: OutputFormat | None, as_json: bool, *, check: bool = False) -> Output:
    """The sink for this command: its own -o/--json win over the global ones. `-o nagios` only for a `check`
    command (one whose exit code is a monitoring plugin's)."""
    from kvctl.errors import UsageError

    state = ctx.find_root().obj
    if output is not None and as_json and output is not OutputFormat.json:
        raise UsageError("--json and -o disagree", hint="give only one of them")
    chosen = OutputFormat.json if as_json else (output or state.output)
    if chosen is OutputFormat.nagios and not check:
        raise UsageError(f"{ctx.command_path}: -o nagios is a check's output",
                         hint="the checks are kvctl doctor and kvctl tiers")
    return Output(format=chosen, color=state.color)


GiveUpOpt = Annotated[float, typer.Option(
    "--give-up-after", min=0.1, metavar="SECONDS",
    help="Stop the load with an error (exit 3) once the router has refused every connection this long; "
         "meanwhile its calls back off, up to 1 s apart.")]
WorkerOpt = Annotated[str | None, typer.Option("--worker", show_default=False,
                                              help="Only this worker: ID (every dp rank) or ID:DP.")]


def worker_selector(text: str | None) -> WorkerSelector | None:
    """--worker as (worker_id, dp_rank or None); None when not given. A worker that cannot be (not ID or ID:DP,
    out of u64/u32) is a usage error (exit 2) before anything is asked of a router or read from a file."""
    if text is None:
        return None
    from kvctl.errors import UsageError

    try:
        return parse_worker(text)
    except ValueError as exc:
        raise UsageError(f"--worker: {exc}", hint="e.g. --worker 3, or --worker 3:0 for one dp rank") from None


YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Go ahead without asking (needed without a terminal).")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Say what would be done; change nothing.")]


def confirm(action: str, yes: bool) -> None:
    """Ask before a change, unless --yes; without a terminal to ask on, refuse (never hang a script)."""
    if yes:
        return
    import sys

    from kvctl.errors import UsageError

    if not sys.stdin.isatty():
        raise UsageError(f"{action}: refusing without --yes (no terminal to ask on)", hint="pass --yes")
    if not typer.confirm(f"{action}?", default=False, err=True):
        typer.echo("cancelled: nothing was changed", err=True)  # the user's answer, not an error: exit 0
        raise typer.Exit(0)


def settings_for(ctx: typer.Context, **flags: Any) -> Settings:
    """The resolved server/token/timeout/prometheus for this command (its own flags win over the root's)."""
    from kvctl.config import resolve

    state = ctx.find_root().obj
    given = {**state.flags, **{k: v for k, v in flags.items() if v is not None}}
    return resolve(given, context=state.context)


def router_client(ctx: typer.Context, server: str | None = None) -> RouterClient:
    """A blocking client for the router this command talks to, or `server` (close it, or use it as a context
    manager)."""
    from kvctl.client import RouterClient

    settings = settings_for(ctx)
    return RouterClient(server or settings.server, token=settings.token, timeout=settings.timeout,
                        warn=Output(color=ctx.find_root().obj.color).warn)


# Credentials for Prometheus and engines' /metrics (never the router's token: that goes to the router only).
MetricsUserOpt = Annotated[str | None, typer.Option("--auth-user", show_default=False,
                                                    help="Basic-auth user for Prometheus or the endpoints.")]
MetricsPasswordOpt = Annotated[str | None, typer.Option("--auth-password", envvar="KVCTL_METRICS_PASSWORD",
                                                        show_default=False, help="Its password.")]
MetricsTokenOpt = Annotated[str | None, typer.Option("--bearer-token", envvar="KVCTL_METRICS_TOKEN",
                                                     show_default=False, help="A bearer token instead.")]


def metrics_window(metrics: list[str] | None, prometheus: str | None, window: str) -> float:
    """The rule every command reading engines' metrics shares: `--metrics` or `--prometheus`, never both,
    and `--window` in seconds; either mistake is a usage error before anything is asked."""
    from kvctl.errors import UsageError

    if metrics and prometheus:
        raise UsageError("--prometheus and --metrics are two sources of engine metrics", hint="give one of them")
    return window_seconds(window)


def window_seconds(window: str) -> float:
    """`--window` (30s, 5m, 1h) in seconds; a usage error (exit 2) naming the option otherwise."""
    from kvctl.core.tiers import parse_duration
    from kvctl.errors import UsageError

    try:
        return parse_duration(window)
    except ValueError as exc:
        raise UsageError(f"--window: {exc}") from None

