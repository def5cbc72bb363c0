"""`kvctl mock`: GPU-free engines that publish real vLLM/SGLang KV events and metrics.

It prints one row per engine first (`-o json` for scripts: the rows carry what `kvctl serve
--worker` and a router's POST /v1/workers need), with --config-out writes the `kvctl serve --config`
file that follows them, then runs until Ctrl-C, SIGTERM or --duration.
The engine code (asyncio, ZMQ, uvicorn) is imported only when the command runs.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import typer

from kvctl.commands._model import model_for
from kvctl.commands._nats import ComponentOpt, EndpointOpt, NamespaceOpt
from kvctl.commands._options import GiveUpOpt, JsonOpt, OutputOpt, output_for, settings_for
from kvctl.core.words import counted
from kvctl.errors import KvctlError, UsageError
from kvctl.mock.load import CONCURRENCY, DRAIN_S, GIVE_UP_S, ROUTER_CALLS, Arrival
from kvctl.output import Column, Output, View

HELP = "Run mock engines that publish real wire-format KV events and metrics (no GPU). (daemon)"
EXAMPLES = (
    "Examples:\n\n"
    "  kvctl mock --engines 4 --config-out fleet.toml\n\n"
    "  kvctl serve --config fleet.toml\n\n"
    "  kvctl mock --format sglang --tiers -o json\n\n"
    "  kvctl mock --drop-every 10 --fault-engine 0 --duration 60"
)
FORMATS = ("vllm", "vllm-legacy", "sglang", "dynamo-nats")  # kvctl.mock.engine.MOCK_FORMATS, not importing it

_VIEW = View(
    rows=lambda engines: engines,
    columns=[
        Column("worker", "worker_id", justify="right"),
        Column("url", "url"),
        Column("endpoint", "endpoint"),
        Column("replay", "replay_endpoint"),
        Column("format", "format"),
        Column("block size", "block_size", justify="right"),
        Column("model", "model", wide_only=True),
        Column("dp", "dp_rank", wide_only=True, justify="right"),
        Column("max running", "max_running", wide_only=True, justify="right"),
        Column("max batched tokens", "max_batched_tokens", wide_only=True, justify="right"),
        Column("timing", "timing", wide_only=True),
    ],
    name_key="worker_id",
)

app = typer.Typer(name="mock", help=HELP, epilog=EXAMPLES)


@app.callback(invoke_without_command=True)
def mock_command(
    ctx: typer.Context,
    engines: Annotated[int, typer.Option("--engines", help="How many engines (worker ids 1..N).")] = 4,
    block_size: Annotated[int, typer.Option("--block-size", "-b", help="Tokens per KV block.")] = 16,
    capacity: Annotated[int, typer.Option("--capacity", help="Device KV-cache size, in blocks.")] = 2048,
    wire_format: Annotated[str, typer.Option("--format", help="Event wire format: vllm, vllm-legacy, sglang (engine "
                                             "ZMQ), or dynamo-nats (RouterEvents on a NATS event plane).")]
    = "vllm",
    nats_url: Annotated[str | None, typer.Option("--nats", show_default=False,
                                                 help="dynamo-nats: the NATS server (nats://HOST:4222).")] = None,
    namespace: NamespaceOpt = "dynamo",
    component: ComponentOpt = "backend",
    endpoint: EndpointOpt = "generate",
    tiers: Annotated[bool, typer.Option("--tiers", help="Add host (2x) and disk (8x) tiers, with KVBM metrics.")]
    = False,
    host: Annotated[str, typer.Option("--host", help="Address every socket binds to.")] = "127.0.0.1",
    base_port: Annotated[int, typer.Option("--base-port", help="Engine i uses base+3i (HTTP), +1 (PUB), +2 "
                                                               "(replay); 0: free ports.")] = 0,
    drop_every: Annotated[int, typer.Option("--drop-every", help="Fault: do not send every Nth batch live "
                                                                 "(replay still has it).")] = 0,
    restart_after: Annotated[float | None, typer.Option("--restart-after", show_default=False,
                                                        help="Fault: restart after this many seconds.")] = None,
    fault_block_size: Annotated[int | None, typer.Option("--fault-block-size", show_default=False,
                                                         help="Fault: use this block size instead.")] = None,
    nondeterministic_hash: Annotated[bool, typer.Option("--nondeterministic-hash",
                                                        help="Fault: a random hash seed per engine.")] = False,
    silent: Annotated[bool, typer.Option("--silent", help="Fault: publish no events at all.")] = False,
    speedup: Annotated[float, typer.Option("--speedup", help="Run the timing model X times faster (Dynamo "
                                                             "mocker's speedup ratio).")] = 1.0,
    max_running: Annotated[int, typer.Option("--max-running", help="Requests an engine runs at once (its batch); "
                                                                   "the rest wait in its queue.")] = 16,
    max_batched_tokens: Annotated[int, typer.Option("--max-batched-tokens", help="Prefill tokens one engine step "
                                                    "computes at most (vLLM's default); a longer prompt is "
                                                    "prefilled in chunks over several steps.")] = 8192,
    slow: Annotated[bool, typer.Option("--slow", help="Fault: prefill and decode 25x slower.")] = False,
    fault_engine: Annotated[list[int] | None, typer.Option("--fault-engine", show_default=False,
                                                           help="Index (from 0) of an engine the faults apply to "
                                                                "(repeatable; default: all).")] = None,
    duration: Annotated[float | None, typer.Option("--duration", "-d", show_default=False,
                                                   help="Stop after this many seconds.")] = None,
    seed: Annotated[int | None, typer.Option("--seed", show_default=False,
                                             help="Makes --nondeterministic-hash reproducible.")] = None,
    config_out: Annotated[Path | None, typer.Option(
        "--config-out", show_default=False, dir_okay=False,
        help="Write the `kvctl serve --config` file that follows these engines (their model, block size and "
             "endpoints) once they listen.")] = None,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
) -> None:
    if ctx.invoked_subcommand is not None:
        return
    out = output_for(ctx, output, as_json)
    _check(engines=engines, block_size=block_size, capacity=capacity, wire_format=wire_format, nats_url=nats_url,
           base_port=base_port, speedup=speedup, max_running=max_running, max_batched_tokens=max_batched_tokens,
           drop_every=drop_every, restart_after=restart_after, fault_block_size=fault_block_size, duration=duration)
    if config_out is not None and wire_format == "dynamo-nats":
        raise UsageError("--config-out declares ZMQ endpoints; dynamo-nats engines have none",
                         hint="follow them with kvctl serve --nats URL instead")

    import asyncio

    from kvctl.mock.engine import EngineConfig, Faults
    from kvctl.mock.fleet import Fleet, fleet_configs, run_until_stopped, serve_file

    faults = Faults(drop_every=drop_every, restart_after=restart_after, block_size=fault_block_size,
                    nondeterministic_hash=nondeterministic_hash, silent=silent, slow=slow)
    base = EngineConfig(worker_id=1, block_size=block_size, capacity=capacity, format=wire_format, host=host,
                        host_capacity=2 * capacity if tiers else 0, disk_capacity=8 * capacity if tiers else 0,
                        speedup=speedup, max_running=max_running, max_batched_tokens=max_batched_tokens,
                        seed=seed, nats_url=nats_url, namespace=namespace, component=component,
                        endpoint=endpoint)
    try:
        configs = fleet_configs(engines, base, base_port=base_port, faults=faults,
                                fault_engines=set(fault_engine) if fault_engine else None)
    except ValueError as exc:
        raise UsageError(str(exc)) from None

    def announce(infos: list[dict[str, Any]]) -> None:
        if config_out is not None:
            from kvctl.config.writer import replace_text
            from kvctl.server.config_file import render

            replace_text(config_out, render(serve_file(infos, block_size)))
            out.note(f"wrote {config_out}: kvctl serve --config {config_out}")
        out.emit(infos, _VIEW)

    try:
        asyncio.run(run_until_stopped(Fleet(configs), duration, announce))
    except OSError as exc:
        raise UsageError(f"cannot bind on {host}: {exc.strerror}", hint="pick another --base-port") from None
    except KeyboardInterrupt:
        pass


def _check(*, engines: int, block_size: int, capacity: int, wire_format: str, nats_url: str | None, base_port: int,
           speedup: float, max_running: int, max_batched_tokens: int, drop_every: int, restart_after: float | None,
           fault_block_size: int | None, duration: float | None) -> None:
    """Reject bad values before anything binds a port."""
    if engines <= 0:
        raise UsageError(f"--engines must be positive, got {engines}")
    if block_size <= 0 or (fault_block_size is not None and fault_block_size <= 0):
        raise UsageError("block sizes must be positive", hint="e.g. --block-size 16")
    if capacity <= 0:
        raise UsageError(f"--capacity must be positive, got {capacity}")
    if wire_format not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, got {wire_format!r}")
    if (wire_format == "dynamo-nats") != (nats_url is not None):
        raise UsageError("--format dynamo-nats and --nats go together", hint="e.g. --format dynamo-nats --nats "
                         "nats://127.0.0.1:4222")
    if base_port and not 0 < base_port <= 65535 - 3 * engines:
        raise UsageError(f"--base-port {base_port} leaves no room for {counted(engines, 'engine')} (3 ports each)")
    if not speedup > 0:
        raise UsageError(f"--speedup must be > 0, got {speedup}", hint="e.g. --speedup 10 runs 10 times faster")
    for name, count in (("--max-running", max_running), ("--max-batched-tokens", max_batched_tokens)):
        if count <= 0:
            raise UsageError(f"{name} must be positive, got {count}")
    if drop_every < 0:
        raise UsageError(f"--drop-every must not be negative, got {drop_every}")
    for name, value in (("--restart-after", restart_after), ("--duration", duration)):
        if value is not None and not value > 0:
            raise UsageError(f"{name} must be > 0 seconds, got {value}")


_LOAD_COLUMNS = [
    Column("policy", "policy"), Column("hit rate", "hit_rate", justify="right"),
    Column("requests", "completed", justify="right"), Column("offered/s", "offered_per_s", justify="right"),
    Column("req/s", "requests_per_s", justify="right"), Column("goodput/s", "goodput_per_s", justify="right"),
    Column("ttft p50 ms", "ttft_p50_ms", justify="right"), Column("ttft p90 ms", "ttft_p90_ms", justify="right"),
    Column("ttft p99 ms", "ttft_p99_ms", justify="right"), Column("e2e p50 ms", "e2e_p50_ms", justify="right"),
    Column("e2e p99 ms", "e2e_p99_ms", justify="right"),
    Column("tokens/s", "output_tokens_per_s", justify="right", wide_only=True),
    Column("engine ttft p50 ms", "engine_ttft_p50_ms", justify="right", wide_only=True),
    *(Column(f"{call.replace('_', ' ')} p50/p99 ms", f"{call}_ms", justify="right", wide_only=True)
      for call in ROUTER_CALLS),
    Column("lag p99 ms", "dispatch_lag_p99_ms", justify="right", wide_only=True),
    Column("peak in flight", "peak_in_flight", justify="right", wide_only=True),
    Column("errors", "errors", wide_only=True),
]
_OPEN_LOOP_KEYS = ("offered_per_s", "goodput_per_s", "dispatch_lag_p99_ms")
"""Columns only some runs have (open loop, a TTFT SLO): shown only then."""


def _load_view(reports: list[dict[str, Any]]) -> View:
    """The load table: the router calls' latencies as `p50/p99` cells, the open-loop and SLO columns only when
    the run has them."""
    absent = {key for key in _OPEN_LOOP_KEYS if not any(key in report for report in reports)}
    return View(rows=lambda rows: [{**row, **{f"{call}_ms": _p50_p99(row["router_calls_ms"].get(call))
                                              for call in ROUTER_CALLS}} for row in rows],
                columns=[column for column in _LOAD_COLUMNS if column.key not in absent], name_key="policy")


def _p50_p99(latency: dict[str, Any] | None) -> str | None:
    return None if latency is None else f"{latency['p50']:g}/{latency['p99']:g}"


LOAD_HELP = ("Drive mock engines through a router (route, prefill complete, free), and optionally a baseline; "
             "report the prefix hit rate the engines achieved, client-side TTFT and end-to-end latency (from each "
             "request's arrival, router calls included), throughput, and with --ttft-slo goodput. Closed loop "
             "(--concurrency in flight) unless --request-rate or a --trace sets arrival times. (read-write)")
LOAD_EXAMPLES = (
    "Examples:\n\n"
    "  kvctl mock -o json > engines.json &   kvctl mock load --engines-file engines.json --baseline random\n\n"
    "  kvctl mock load --engines-file engines.json --request-rate 50 --ttft-slo 200 --baseline random -o wide\n\n"
    "  kvctl mock load --engine 1=http://127.0.0.1:8001 --trace conversation_trace.jsonl --speed 10"
)


@app.command("load", help=LOAD_HELP, epilog=LOAD_EXAMPLES)
def load_command(
    ctx: typer.Context,
    server: Annotated[str | None, typer.Option("--server", "-s", show_default=False,
                                               help="The router (else kvctl --server, KVCTL_SERVER, context).")]
    = None,
    engine: Annotated[list[str] | None, typer.Option("--engine", show_default=False,
                                                     help="WORKER_ID=URL of a mock engine (repeatable).")] = None,
    engines_file: Annotated[Path | None, typer.Option("--engines-file", show_default=False,
                                                      help="The JSON rows of `kvctl mock -o json`, or the .toml "
                                                           "`kvctl mock --config-out` wrote. Engines the "
                                                           "router does not know yet are registered with it "
                                                           "(POST /v1/workers, under --model), and it says so.")]
    = None,
    trace: Annotated[Path | None, typer.Option("--trace", show_default=False,
                                               help="Replay a Mooncake trace instead of the shared-prefix mix.")]
    = None,
    block_tokens: Annotated[int, typer.Option("--block-tokens", help="Trace: tokens per 512-token hash block.")]
    = 64,
    speed: Annotated[float, typer.Option("--speed", help="Trace: replay this many times faster.")] = 1.0,
    requests: Annotated[int, typer.Option("--requests", help="Requests per policy (trace: its first N).")] = 500,
    concurrency: Annotated[int | None, typer.Option(
        "--concurrency", show_default=False,
        help=f"Closed loop: requests in flight (default {CONCURRENCY}). Open loop: the most in flight, later "
             "arrivals wait (default: no cap, as benchmark_serving's --max-concurrency).")] = None,
    request_rate: Annotated[float | None, typer.Option(
        "--request-rate", show_default=False, metavar="REQ/S",
        help="Open loop: requests arrive at this rate whether or not earlier ones are done (the same arrival "
             "times for every policy, from --seed).")] = None,
    arrival: Annotated[Arrival | None, typer.Option(
        "--arrival", show_default=False,
        help="With --request-rate: poisson (exponential gaps, the default) or constant spacing.")] = None,
    ttft_slo: Annotated[float | None, typer.Option(
        "--ttft-slo", show_default=False, metavar="MS",
        help="Add goodput: requests completed per second whose client-side TTFT was within MS.")] = None,
    drain_timeout: Annotated[float, typer.Option(
        "--drain-timeout", metavar="SECONDS",
        help="Open loop: once the last request is sent, how long those in flight may take to finish; the "
             "rest are cancelled and counted as drain_timeout errors.")] = DRAIN_S,
    baseline: Annotated[str | None, typer.Option("--baseline", show_default=False,
                                                 help="Also run random or round-robin, from cold caches too.")]
    = None,
    model: Annotated[str | None, typer.Option("--model", "-m", show_default=False,
                                              help="The router's model (default: the engines-file's model if "
                                                   "it names one, else as for every command).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Workload, baseline and arrival seed.")] = 0,
    give_up_after: GiveUpOpt = GIVE_UP_S,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
) -> None:
    out = output_for(ctx, output, as_json)
    rows = _engine_rows(engines_file)
    targets = _engine_urls(engine or [], rows)
    if baseline not in (None, "random", "round-robin"):
        raise UsageError(f"--baseline must be random or round-robin, got {baseline!r}")
    if requests <= 0 or (concurrency is not None and concurrency <= 0) or block_tokens <= 0 or not speed > 0:
        raise UsageError("--requests, --concurrency, --block-tokens and --speed must be positive")
    if trace is not None and not trace.is_file():
        raise UsageError(f"--trace: no such file {str(trace)!r}")
    positive = {"--request-rate": request_rate, "--ttft-slo": ttft_slo, "--drain-timeout": drain_timeout}
    for name, value in positive.items():
        if value is not None and not value > 0:
            raise UsageError(f"{name} must be > 0, got {value:g}")
    if trace is not None and request_rate is not None:
        raise UsageError("--request-rate and --trace: a trace brings its own arrival times",
                         hint="use --speed to replay it faster")
    if arrival is not None and request_rate is None:
        raise UsageError("--arrival spaces the arrivals of --request-rate", hint="add --request-rate REQ/S")
    import asyncio

    from kvctl.mock.load import LoadStats, Policy, mooncake_trace, run_policies, shared_prefix
    from kvctl.output.progress import ProgressLine

    workload = (mooncake_trace(trace, block_tokens=block_tokens, speed=speed, limit=requests) if trace
                else shared_prefix(requests, seed=seed))
    policies = [Policy.router] + ([Policy(baseline)] if baseline else [])
    settings = settings_for(ctx, server=server)
    model = model or _model_of(rows) or model_for(ctx, out, None, settings.server)
    try:
        with ProgressLine(out, "{task.fields[sent]} sent  {task.fields[rate]} req/s") as line:
            rows_of: dict[Policy, int] = {}

            def progress(stats: LoadStats) -> None:
                if stats.policy not in rows_of:
                    rows_of[stats.policy] = line.task(stats.policy.value, len(workload), sent=0, rate="0.0")
                line.update(rows_of[stats.policy], stats.completed, sent=stats.sent,
                            rate=f"{stats.per_s(stats.completed):.1f}")

            reports = asyncio.run(run_policies(settings.server, targets, rows, workload, policies, concurrency,
                                               model, seed, partial(_registered, out, settings.server, model),
                                               token=settings.token, give_up_s=give_up_after, progress=progress,
                                               request_rate=request_rate, arrival=arrival or Arrival.poisson,
                                               ttft_slo_ms=ttft_slo, drain_s=drain_timeout))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    out.emit(reports, _load_view(reports))
    for report in reports:
        if report["completed"] == 0:
            raise KvctlError(f"{report['policy']}: no request completed ({report['first_error'] or report['errors']})")


def _model_of(rows: list[dict[str, Any]]) -> str | None:
    """The one model the engines-file's engines serve, if they name one: the load asks the router for the model
    its engines are registered under."""
    models = {row["model"] for row in rows if row.get("model")}
    return models.pop() if len(models) == 1 else None


def _registered(out: Output, server: str, model: str, workers: list[str]) -> None:
    """One line when --engines-file engines were registered: the router's worker list changed."""
    if workers:
        out.note(f"registered {counted(len(workers), 'engine')} with {server} (model {model!r}): {', '.join(workers)}")


def _engine_rows(engines_file: Path | None) -> list[dict[str, Any]]:
    """The engines of `kvctl mock -o json`'s rows, or of the `kvctl serve --config` file `kvctl mock --config-out`
    writes (TOML, with each engine's `engine_url`)."""
    if engines_file is None:
        return []
    if engines_file.suffix == ".toml":
        return _serve_file_rows(engines_file)
    try:
        rows = json.loads(engines_file.read_text())
        return [{"worker_id": int(row["worker_id"]), "url": str(row["url"]), "endpoint": row.get("endpoint"),
                 "replay_endpoint": row.get("replay_endpoint"), "model": row.get("model")} for row in rows]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--engines-file {engines_file}: not the rows of `kvctl mock -o json` ({exc})",
                         hint="or give the .toml file `kvctl mock --config-out` wrote") from None


def _serve_file_rows(path: Path) -> list[dict[str, Any]]:
    from kvctl.errors import ConfigError
    from kvctl.server.config_file import load

    try:
        fleet = load(path)
    except ConfigError as exc:
        raise UsageError(f"--engines-file {exc.message}") from None
    missing = [w.worker_id for w in fleet.workers if w.key not in fleet.engine_urls]
    if missing:
        raise UsageError(f"--engines-file {path}: worker {missing[0]} has no engine_url (its HTTP API, which the "
                         "load drives)", hint="write the file with `kvctl mock --config-out`, or add engine_url")
    return [{"worker_id": w.worker_id, "url": fleet.engine_urls[w.key], "endpoint": w.endpoint,
             "replay_endpoint": w.replay_endpoint, "model": w.model} for w in fleet.workers]


def _engine_urls(specs: list[str], rows: list[dict[str, Any]]) -> dict[int, str]:
    urls: dict[int, str] = {row["worker_id"]: row["url"] for row in rows}
    for spec in specs:
        worker_id, sep, url = spec.partition("=")
        if not sep or not worker_id.isdigit() or not url.startswith("http"):
            raise UsageError(f"--engine wants WORKER_ID=URL, got {spec!r}", hint="e.g. --engine 1=http://127.0.0.1:8001")
        urls[int(worker_id)] = url
    if not urls:
        raise UsageError("no engines: give --engine WORKER_ID=URL or --engines-file")
    return urls
