"""`kvctl mock`: GPU-free engines that publish real vLLM/SGLang KV events and metrics.

It prints one row per engine first (`-o json` for scripts: the rows carry what `kvctl serve
--worker` and a router's POST /v1/workers need), then runs until Ctrl-C, SIGTERM or --duration.
The engine code (asyncio, ZMQ, uvicorn) is imported only when the command runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvctl.commands._options import JsonOpt, OutputOpt, output_for
from kvctl.errors import UsageError
from kvctl.output import Column, View

if TYPE_CHECKING:
    from kvctl.mock.fleet import Fleet

HELP = "Run mock engines that publish real wire-format KV events and metrics (no GPU). [read-only]"
EXAMPLES = (
    "Examples:\n\n"
    "  kvctl mock --engines 4\n\n"
    "  kvctl mock --format sglang --tiers -o json\n\n"
    "  kvctl mock --drop-every 10 --fault-engine 0 --duration 60"
)
FORMATS = ("vllm", "vllm-legacy", "sglang")  # kvctl.mock.engine.MOCK_FORMATS, without importing the engine

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
    ],
    name_key="worker_id",
)

app = typer.Typer(name="mock", help=HELP, epilog=EXAMPLES)


@app.callback(invoke_without_command=True)
def mock_command(
    ctx: typer.Context,
    engines: Annotated[int, typer.Option("--engines", "-n", help="How many engines (worker ids 1..N).")] = 4,
    block_size: Annotated[int, typer.Option("--block-size", "-b", help="Tokens per KV block.")] = 16,
    capacity: Annotated[int, typer.Option("--capacity", help="Device KV-cache size, in blocks.")] = 2048,
    wire_format: Annotated[str, typer.Option("--format", help="Event wire format: vllm, vllm-legacy or sglang.")]
    = "vllm",
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
    slow: Annotated[bool, typer.Option("--slow", help="Fault: prefill and decode 25x slower.")] = False,
    fault_engine: Annotated[list[int] | None, typer.Option("--fault-engine", show_default=False,
                                                           help="Index (from 0) of an engine the faults apply to "
                                                                "(repeatable; default: all).")] = None,
    duration: Annotated[float | None, typer.Option("--duration", show_default=False,
                                                   help="Stop after this many seconds.")] = None,
    seed: Annotated[int | None, typer.Option("--seed", show_default=False,
                                             help="Makes --nondeterministic-hash reproducible.")] = None,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
) -> None:
    if ctx.invoked_subcommand is not None:
        return
    out = output_for(ctx, output, as_json)
    _check(engines=engines, block_size=block_size, capacity=capacity, wire_format=wire_format, base_port=base_port,
           drop_every=drop_every, restart_after=restart_after, fault_block_size=fault_block_size, duration=duration)

    from kvctl.mock.engine import EngineConfig, Faults
    from kvctl.mock.fleet import Fleet, fleet_configs

    faults = Faults(drop_every=drop_every, restart_after=restart_after, block_size=fault_block_size,
                    nondeterministic_hash=nondeterministic_hash, silent=silent, slow=slow)
    base = EngineConfig(worker_id=1, block_size=block_size, capacity=capacity, format=wire_format, host=host,
                        host_capacity=2 * capacity if tiers else 0, disk_capacity=8 * capacity if tiers else 0,
                        seed=seed)
    try:
        configs = fleet_configs(engines, base, base_port=base_port, faults=faults,
                                fault_engines=set(fault_engine) if fault_engine else None)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        asyncio.run(_run(Fleet(configs), duration, lambda infos: out.emit(infos, _VIEW)))
    except OSError as exc:
        raise UsageError(f"cannot bind on {host}: {exc.strerror}", hint="pick another --base-port") from None
    except KeyboardInterrupt:
        pass


def _check(*, engines: int, block_size: int, capacity: int, wire_format: str, base_port: int, drop_every: int,
           restart_after: float | None, fault_block_size: int | None, duration: float | None) -> None:
    """Reject bad values before anything binds a port."""
    if engines <= 0:
        raise UsageError(f"--engines must be positive, got {engines}")
    if block_size <= 0 or (fault_block_size is not None and fault_block_size <= 0):
        raise UsageError("block sizes must be positive", hint="e.g. --block-size 16")
    if capacity <= 0:
        raise UsageError(f"--capacity must be positive, got {capacity}")
    if wire_format not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, got {wire_format!r}")
    if base_port and not 0 < base_port <= 65535 - 3 * engines:
        raise UsageError(f"--base-port {base_port} leaves no room for {engines} engines (3 ports each)")
    if drop_every < 0:
        raise UsageError(f"--drop-every must not be negative, got {drop_every}")
    for name, value in (("--restart-after", restart_after), ("--duration", duration)):
        if value is not None and not value > 0:
            raise UsageError(f"{name} must be > 0 seconds, got {value}")


async def _run(fleet: Fleet, duration: float | None, announce: Callable[[list[dict[str, Any]]], None]) -> None:
    """Start the fleet, announce it, and wait for a signal or the end of `duration`; always close."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    handled = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread, or Windows
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)
    try:
        async with fleet:
            announce(fleet.infos())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), duration)
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
