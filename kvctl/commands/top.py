"""`kvctl top`: a router's whole state, live, in a terminal (Textual); `--once` prints one frame as text.

Textual and the dashboard are imported only when the command runs, so other commands start fast.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvctl.commands._options import (
    JsonOpt,
    MetricsPasswordOpt,
    MetricsTokenOpt,
    MetricsUserOpt,
    OutputOpt,
    metrics_window,
    output_for,
    settings_for,
)
from kvctl.errors import UsageError

if TYPE_CHECKING:
    from kvctl.client.tier_sources import Auth
    from kvctl.output import Output
    from kvctl.tui.sources import Source

HELP = ("Live dashboard of a router: workers, rates, stream health, tiers, its routing audit, shared prefixes; "
        "with --admin `r` resets a worker, after a confirmation. (read-only; read-write with --admin)")
EXAMPLES = (
    "Examples:\n\n"
    "  kvctl top\n\n"
    "  kvctl top --server http://router:7433 --metrics http://engine-0:8000 --metrics http://engine-1:8000\n\n"
    "  kvctl top --record incident.jsonl      # later: kvctl top --replay incident.jsonl\n\n"
    "  kvctl top --once -o json | jq '.workers[] | select(.marks != [])'\n\n"
    "  kvctl top --once -o json | jq .audit.optimal_share      # the routing audit's last 5 minutes\n\n"
    "Keys: q (or Ctrl-C) quit, p pause, s sort, / filter, t shared prefixes, enter worker detail, ? help, "
    "r reset (--admin)."
)


def top_command(
    ctx: typer.Context,
    interval: Annotated[float, typer.Option("--interval", help="Seconds between polls.")] = 1.0,
    admin: Annotated[bool, typer.Option("--admin", help="Allow `r` to reset the selected worker (read-write; "
                                                        "needs the router's admin token if it has one).")] = False,
    record: Annotated[Path | None, typer.Option("--record", show_default=False, dir_okay=False,
                                                help="Also write every poll to FILE (JSON lines).")] = None,
    replay: Annotated[Path | None, typer.Option("--replay", show_default=False, dir_okay=False, exists=True,
                                                help="Show a --record FILE again instead of a router.")] = None,
    once: Annotated[bool, typer.Option("--once", help="Print one frame as text and exit (no terminal needed); "
                                                      "it takes two polls, --interval apart, for the rates.")] = False,
    iterations: Annotated[int | None, typer.Option("--iterations", min=1, show_default=False, help=(
        "Stop after N polls; without a terminal, print a frame after each.")), ] = None,
    prometheus: Annotated[str | None, typer.Option("--prometheus", show_default=False, help=(
        "Prometheus URL for the tiers panel (KVCTL_PROMETHEUS, or the context's `prometheus`).")), ] = None,
    metrics: Annotated[list[str] | None, typer.Option("--metrics", show_default=False, help=(
        "An engine's /metrics URL for the tiers panel instead (repeatable).")), ] = None,
    window: Annotated[str, typer.Option("--window", help="The tiers' window with --prometheus: 30s, 5m, 1h.")] = "5m",
    auth_user: MetricsUserOpt = None,
    auth_password: MetricsPasswordOpt = None,
    bearer_token: MetricsTokenOpt = None,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
) -> None:
    out = output_for(ctx, output, as_json)
    if not interval > 0:
        raise UsageError(f"--interval must be > 0 seconds, got {interval}")
    if once and iterations is not None:
        raise UsageError("--once is one frame; --iterations N is N frames", hint="give one of them")
    if replay is not None and (record is not None or admin):
        raise UsageError("--replay shows a recording: it cannot be recorded again or reset",
                         hint="drop --record/--admin")
    interactive = not once and sys.stdout.isatty() and sys.stdin.isatty()
    if not interactive and not once and iterations is None:
        raise UsageError("kvctl top needs a terminal", hint="use --once, or --iterations N, to print frames as text")
    from kvctl.client.tier_sources import Auth

    auth = Auth(auth_user, auth_password, bearer_token)
    window_s = metrics_window(metrics, prometheus, window)
    source = _source(ctx, replay, record, prometheus, metrics or [], window_s, auth)
    if interactive:
        from kvctl.runtime import tuned_gc
        from kvctl.tui.app import TopApp

        with tuned_gc():  # full collections walking every widget were the slowest refreshes (~75 ms)
            TopApp(source, interval=interval, admin=admin, iterations=iterations).run()
    else:
        import asyncio

        asyncio.run(_print_frames(source, out, interval, 2 if once else iterations or 1, once))


def _source(ctx: typer.Context, replay: Path | None, record: Path | None, prometheus: str | None,
            metrics: list[str], window_s: float, auth: Auth) -> Source:
    """The source the flags name: a recording, or the router (recorded to a file with --record)."""
    from kvctl.tui.sources import Recorder, ReplaySource

    if replay is not None:
        return ReplaySource(replay)
    from kvctl.client import AsyncRouterClient
    from kvctl.tui.sources import LiveSource, TierFeed

    settings = settings_for(ctx, prometheus=prometheus)
    tiers = None
    if metrics or settings.prometheus:
        tiers = TierFeed(prometheus=settings.prometheus if not metrics else None, metrics=metrics,
                         auth=auth, timeout=settings.timeout, window_s=window_s)
    client = AsyncRouterClient(settings.server, token=settings.token, timeout=settings.timeout)
    live = LiveSource(client, token=settings.token, timeout=settings.timeout, tiers=tiers)
    return Recorder(live, record) if record is not None else live


async def _print_frames(source: Source, out: Output, interval: float, polls: int, once: bool) -> None:
    """Frames as text, for scripts and CI. With --once only the last of its two polls is printed: the first
    one is there for the rates."""
    import asyncio

    from kvctl.tui.frame import FrameBuilder
    from kvctl.tui.sources import EndOfRecording
    from kvctl.tui.views import emit_frame

    builder = FrameBuilder(source.label)
    frame = None
    try:
        for n in range(polls):
            if n:
                await asyncio.sleep(interval)
            try:
                frame = builder.update(await source.poll())
            except EndOfRecording:
                break
            if not once:
                emit_frame(out, frame)
        if once and frame is not None:
            emit_frame(out, frame)
    finally:
        await source.aclose()
