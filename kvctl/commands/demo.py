"""`kvctl demo`: the whole job on one machine, no GPU: a router, mock engines and load, on loopback."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvctl.commands._options import GiveUpOpt, JsonOpt, OutputOpt, output_for
from kvctl.core.words import counted
from kvctl.errors import UsageError
from kvctl.mock.demo import OFFERED_SHARE, TTFT_SLO_MS
from kvctl.mock.load import GIVE_UP_S
from kvctl.output import Column, Output, View

if TYPE_CHECKING:
    from kvctl.mock.load import LoadStats

HELP = ("Start a router, mock engines and load on loopback ports; measure what KV-aware routing buys over random "
        "placement, at equal offered load and at capacity. (read-only)")
EXAMPLES = ("Examples:\n\n  kvctl demo\n\n  kvctl demo --duration 20 -o json\n\n"
            "  kvctl demo --ttft-slo 500 --request-rate 40")

_VIEW = View(
    rows=lambda result: phase_rows(result),
    columns=[Column("phase", "phase"), Column("policy", "policy"),
             Column("offered", "offered_per_s", justify="right"),
             Column("concurrency", "concurrency", justify="right", wide_only=True),
             Column("seconds", "duration_s", justify="right"),
             Column("hit rate", "hit_rate", justify="right"),
             Column("req/s", "requests_per_s", justify="right"),
             Column("goodput", "goodput_per_s", justify="right"),
             Column("ttft p50 ms", "ttft_p50_ms", justify="right", wide_only=True),
             Column("ttft p90 ms", "ttft_p90_ms", justify="right"),
             Column("ttft p99 ms", "ttft_p99_ms", justify="right"),
             Column("e2e p50 ms", "e2e_p50_ms", justify="right"),
             Column("errors", "errors", wide_only=True)],
    name_key="phase",
    title="shared-prefix workload, cold caches each phase; the open-loop phases of equal length and offered load",
)


def demo_command(
    ctx: typer.Context,
    duration: Annotated[float, typer.Option("--duration", "-d", help="Seconds in all: a quarter for each policy's "
                                                                      "capacity, a quarter for each's open loop.")]
    = 60.0,
    engines: Annotated[int, typer.Option("--engines", help="Mock engines.")] = 4,
    ttft_slo: Annotated[float, typer.Option("--ttft-slo", help="TTFT target in ms: goodput counts the requests "
                                                               "within it; capacity is the best rate whose TTFT "
                                                               "p90 meets it.")] = TTFT_SLO_MS,
    request_rate: Annotated[float | None, typer.Option(
        "--request-rate", show_default=False,
        help=f"Open-loop offered load in req/s, the same for both policies (default: {OFFERED_SHARE:.0%} of random "
             "placement's measured capacity).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Workload seed.")] = 0,
    give_up_after: GiveUpOpt = GIVE_UP_S,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
) -> None:
    out = output_for(ctx, output, as_json)
    if not duration >= 4:
        raise UsageError(f"--duration must be at least 4 seconds (four phases), got {duration}")
    if not 1 <= engines <= 64:
        raise UsageError(f"--engines must be 1..64, got {engines}")
    if not ttft_slo > 0:
        raise UsageError(f"--ttft-slo must be > 0 ms, got {ttft_slo}")
    if request_rate is not None and not request_rate > 0:
        raise UsageError(f"--request-rate must be > 0 req/s, got {request_rate}")
    import asyncio

    from kvctl.mock.demo import DemoPlan, run_demo

    plan = DemoPlan(engines=engines, duration_s=duration, ttft_slo_ms=ttft_slo, request_rate=request_rate,
                    seed=seed, give_up_s=give_up_after)
    live = _LiveSummary(out) if sys.stderr.isatty() else None
    progress = live.update if live is not None else (lambda phase, stats: _progress(out, phase, stats))
    try:
        with live or contextlib.nullcontext():
            result = asyncio.run(run_demo(plan, lambda url, infos: _announce(out, url, infos), progress,
                                          every_s=0.5 if live else 2.0))
    except KeyboardInterrupt:
        out.note("interrupted: everything the demo started is stopped")
        raise typer.Exit(130) from None
    out.emit(result, _VIEW)
    for line in summary(result):
        out.note(line)


def phase_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The table's rows: each policy at capacity (its best step), then each at the open loop's offered rate."""
    rows = []
    for policy, found in result["capacity"].items():
        best = found.get("best") or {}
        rows.append({**best, "phase": "capacity", "policy": policy, "duration_s": found.get("duration_s")})
    rows += [{**report, "phase": "open-loop"} for report in result["open_loop"].values()]
    return rows


def summary(result: dict[str, Any]) -> list[str]:
    """The lines under the table: the timing model, the verdict in numbers, what the router cost and where the
    CPU went."""
    lines = [f"engines: {counted(result['engines'], 'mock engine')} in their own process; timing: {result['timing']}"]
    random_, routed = result["open_loop"]["random"], result["open_loop"]["router"]
    if result["engines"] == 1:
        return [*lines, "one engine: there is nothing to choose, both policies send every request to it; the "
                        "differences are the phases' own, not routing (try --engines 4)"]
    lines.append(f"at {result['offered_per_s']:g} req/s offered to both: TTFT p90 {_ms(random_['ttft_p90_ms'])} -> "
                 f"{_ms(routed['ttft_p90_ms'])} ms, end-to-end p50 {_ms(random_['e2e_p50_ms'])} -> "
                 f"{_ms(routed['e2e_p50_ms'])} ms, goodput (TTFT <= {result['ttft_slo_ms']:g} ms) "
                 f"{random_.get('goodput_per_s')} -> {routed.get('goodput_per_s')} req/s, prefix hit rate "
                 f"{result['hit_rate_gain_points']:+.1f} points with KV-aware routing")
    lines.append(_capacity_line(result))
    calls = routed.get("router_calls_ms") or {}
    decision = routed.get("route_decision_ms") or {}
    lines.append("router cost per request (open loop, as the load generator saw it): "
                 + ", ".join(f"{name.replace('_', ' ')} p50 {_ms(c['p50'])} / p99 {_ms(c['p99'])} ms"
                             for name, c in calls.items())
                 + f"; the router's own route decision p50 {_ms(decision.get('p50'))} / p99 "
                   f"{_ms(decision.get('p99'))} ms")
    lines.append(f"CPU while routing (cores busy of {os.cpu_count()}): "
                 + ", ".join(f"{name} {_ms(cores)}" for name, cores in (routed.get("cpu_cores") or {}).items()))
    return lines


def _capacity_line(result: dict[str, Any]) -> str:
    best = {policy: found.get("best") or {} for policy, found in result["capacity"].items()}
    caps = {policy: step.get("requests_per_s") for policy, step in best.items()}
    text = f"capacity (TTFT p90 <= {result['ttft_slo_ms']:g} ms, closed loop): " + ", ".join(
        f"{policy} {_ms(caps[policy])} req/s ({step['concurrency']} in flight)" if step
        else f"{policy}: no concurrency met it (try a larger --ttft-slo)" for policy, step in best.items())
    if caps["router"] is not None and caps["random"] is not None and caps["router"] < caps["random"]:
        routed = result["open_loop"]["router"]
        route = (routed.get("router_calls_ms") or {}).get("route") or {}
        cores = routed.get("cpu_cores") or {}
        text += (f"; the router's is lower here: each request paid its route call (p50 {_ms(route.get('p50'))} ms) "
                 f"and the {os.cpu_count()} cores are shared by the router, the engines and this load generator "
                 f"({', '.join(f'{n} {_ms(c)}' for n, c in cores.items())} cores busy)")
    return text


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

    def update(self, phase: str, stats: LoadStats) -> None:
        from rich.table import Table

        self._rows[phase] = stats.report()
        table = Table(title="kvctl demo: placement compared (Ctrl-C stops everything)", box=None)
        for header in ("phase", "elapsed s", "hit rate", "done", "req/s", "ttft p90 ms", "errors"):
            table.add_column(header, justify="left" if header == "phase" else "right")
        for name, r in self._rows.items():
            table.add_row(name, f"{r['duration_s']:.1f}", f"{100 * r['hit_rate']:.1f}%", str(r["completed"]),
                          f"{r['requests_per_s']:.1f}", _ms(r["ttft_p90_ms"]), str(sum(r["errors"].values())))
        self._live.update(table, refresh=True)


def _progress(out: Output, phase: str, stats: LoadStats) -> None:
    r = stats.report()
    out.note(f"[{phase}] {r['duration_s']:5.1f}s  hit rate {100 * r['hit_rate']:5.1f}%  "
             f"{r['completed']:5d} done  {r['requests_per_s']:6.1f} req/s  ttft p90 {_ms(r['ttft_p90_ms'])} ms"
             + (f"  errors {r['errors']}" if r["errors"] else ""))


def _ms(value: float | None) -> str:
    """A latency, or `-` before the first request has finished (never `None` on a person's screen)."""
    return "-" if value is None else f"{value:g}"
