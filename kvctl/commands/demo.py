"""`kvctl demo`: the whole job on one machine, no GPU: a router, mock engines and load, on loopback."""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvctl.commands._options import GiveUpOpt, JsonOpt, OutputOpt, output_for
from kvctl.errors import UsageError
from kvctl.mock.load import GIVE_UP_S
from kvctl.output import Column, Output, View

if TYPE_CHECKING:
    from kvctl.mock.load import LoadStats

HELP = ("Start a router, mock engines and load on loopback ports; show what KV-aware routing buys over random "
        "placement. (read-only)")
EXAMPLES = "Examples:\n\n  kvctl demo\n\n  kvctl demo --duration 20 -o json"

_VIEW = View(
    rows=lambda result: [result["baseline"], result["router"]],
    columns=[Column("policy", "policy"), Column("seconds", "duration_s", justify="right"),
             Column("hit rate", "hit_rate", justify="right"),
             Column("requests", "completed", justify="right"), Column("req/s", "requests_per_s", justify="right"),
             Column("ttft p50 ms", "ttft_p50_ms", justify="right"),
             Column("ttft p99 ms", "ttft_p99_ms", justify="right"),
             Column("errors", "errors", wide_only=True)],
    name_key="policy",
    title="shared-prefix workload, cold caches each, both phases as long",
)


def demo_command(
    ctx: typer.Context,
    duration: Annotated[float, typer.Option("--duration", "-d", help="Seconds in all, half for the random "
                                                                      "baseline, half for the router.")] = 60.0,
    engines: Annotated[int, typer.Option("--engines", help="Mock engines.")] = 4,
    concurrency: Annotated[int, typer.Option("--concurrency", help="Requests in flight.")] = 16,
    seed: Annotated[int, typer.Option("--seed", help="Workload seed.")] = 0,
    give_up_after: GiveUpOpt = GIVE_UP_S,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
) -> None:
    out = output_for(ctx, output, as_json)
    if not duration >= 2:
        raise UsageError(f"--duration must be at least 2 seconds, got {duration}")
    if not 1 <= engines <= 64:
        raise UsageError(f"--engines must be 1..64, got {engines}")
    if concurrency < 1:
        raise UsageError(f"--concurrency must be positive, got {concurrency}")
    import asyncio

    from kvctl.mock.demo import DemoPlan, run_demo

    plan = DemoPlan(engines=engines, duration_s=duration, concurrency=concurrency, seed=seed,
                    give_up_s=give_up_after)
    live = _LiveSummary(out) if sys.stderr.isatty() else None
    progress = live.update if live is not None else (lambda stats: _progress(out, stats))
    try:
        with live or contextlib.nullcontext():
            result = asyncio.run(run_demo(plan, lambda url, infos: _announce(out, url, infos), progress,
                                          every_s=0.5 if live else 2.0))
    except KeyboardInterrupt:
        out.note("interrupted: everything the demo started is stopped")
        raise typer.Exit(130) from None
    out.emit(result, _VIEW)
    out.note(_verdict(result, engines))


def _verdict(result: dict[str, Any], engines: int) -> str:
    """The line under the table: the gain, or why there is none to read with a single engine."""
    gain = f"{result['hit_rate_gain_points']:+.1f} points"
    if engines == 1:
        return (f"one engine: there is nothing to choose, both policies send every request to it; the {gain} "
                "are the two phases' own difference, not routing (try --engines 4)")
    return f"KV-aware routing: {gain} of prefix hit rate over random, in phases of equal length"


def _announce(out: Output, url: str, infos: list[dict[str, Any]]) -> None:
    out.note(f"router     {url}   (kvctl serve, its own process)")
    for info in infos:
        out.note(f"engine {info['worker_id']:<3} {info['url']}   events {info['endpoint']}")
    out.note(f"try, while it runs:\n  kvctl --server {url} workers\n  kvctl --server {url} tree stats\n"
             f"  curl -s {url}/v1/status | jq .streams\n  curl -s {url}/metrics | grep kvctl_\n")


class _LiveSummary:
    """With a terminal: one live table on stderr, a row per phase, redrawn as the load runs."""

    def __init__(self, out: Output) -> None:
        from rich.console import Console
        from rich.live import Live

        self._rows: dict[str, dict[str, Any]] = {}
        self._live = Live(console=Console(file=out.stderr, no_color=not out.color), auto_refresh=False)

    def __enter__(self) -> _LiveSummary:
        self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._live.__exit__(None, None, None)

    def update(self, stats: LoadStats) -> None:
        from rich.table import Table

        report = stats.report()
        self._rows[report["policy"]] = report
        table = Table(title="kvctl demo: prefix hit rate by placement (Ctrl-C stops everything)", box=None)
        for header in ("policy", "elapsed s", "hit rate", "done", "req/s", "ttft p50 ms", "errors"):
            table.add_column(header, justify="left" if header == "policy" else "right")
        for r in self._rows.values():
            table.add_row(r["policy"], f"{r['duration_s']:.1f}", f"{100 * r['hit_rate']:.1f}%", str(r["completed"]),
                          f"{r['requests_per_s']:.1f}", _ms(r["ttft_p50_ms"]), str(sum(r["errors"].values())))
        self._live.update(table, refresh=True)


def _progress(out: Output, stats: LoadStats) -> None:
    r = stats.report()
    out.note(f"[{r['policy']:>6}] {r['duration_s']:5.1f}s  hit rate {100 * r['hit_rate']:5.1f}%  "
             f"{r['completed']:5d} done  {r['requests_per_s']:6.1f} req/s  ttft p50 {_ms(r['ttft_p50_ms'])} ms"
             + (f"  errors {r['errors']}" if r["errors"] else ""))



def _ms(value: float | None) -> str:
    """A latency, or `-` before the first request has finished (never `None` on a person's screen)."""
    return "-" if value is None else f"{value:g}"
