"""`kvctl serve`: the router daemon. The server code is imported only when this command runs."""

from __future__ import annotations

import asyncio
import logging
import os
import re
from pathlib import Path
from typing import Annotated

import typer

from kvctl.errors import UsageError
from kvctl.output import Output

HELP = "Run a router + KV indexer daemon: engine ZMQ events in, routing decisions out. [read-write]"
EXAMPLES = (
    "Examples:\n\n"
    "  kvctl serve\n\n"
    "  kvctl serve --listen 127.0.0.1:0 --worker 1=tcp://127.0.0.1:5557\n\n"
    "  kvctl serve --worker 7:1=tcp://10.0.0.7:5558,replay=tcp://10.0.0.7:5600,model=llama"
)

DEFAULT_STATE_DIR = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "kvctl"

_ENGINE = re.compile(r"^(?P<id>\d+)(?::(?P<dp>\d+))?=(?P<endpoint>[^,]+)(?P<opts>(,[a-z_]+=[^,]*)*)$")


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535 or not host:
        raise UsageError(f"--listen wants HOST:PORT, got {text!r}", hint="e.g. --listen 127.0.0.1:7433 (port 0: any)")
    return host.strip("[]"), int(port)


def parse_engine(text: str):  # type: ignore[no-untyped-def]
    from kvctl.server.daemon import EngineSpec

    m = _ENGINE.match(text)
    if m is None:
        raise UsageError(f"--worker wants ID[:DP]=tcp://HOST:PORT[,replay=…][,model=…][,topic=…], got {text!r}")
    opts = dict(kv.split("=", 1) for kv in m["opts"].split(",") if kv)
    unknown = set(opts) - {"replay", "model", "topic"}
    if unknown:
        raise UsageError(f"--worker: unknown option {sorted(unknown)[0]!r}", hint="known: replay, model, topic")
    return EngineSpec(int(m["id"]), int(m["dp"] or 0), m["endpoint"], opts.get("replay"),
                      opts.get("model", "default"), opts.get("topic", ""))


def serve_command(
    ctx: typer.Context,
    listen: Annotated[str, typer.Option("--listen", envvar="KVCTL_LISTEN", help="HOST:PORT to bind (port 0: any).")]
    = "127.0.0.1:7433",
    block_size: Annotated[int, typer.Option("--block-size", envvar="KVCTL_BLOCK_SIZE", help="Tokens per KV block.")]
    = 16,
    worker: Annotated[list[str] | None, typer.Option("--worker", "-w", help="An engine's KV-event endpoint "
                                                     "(repeatable).")] = None,
    admin_token: Annotated[str | None, typer.Option("--admin-token", envvar="KVCTL_ADMIN_TOKEN", show_default=False,
                                                    help="Bearer token required by mutating endpoints.")] = None,
    insecure: Annotated[bool, typer.Option("--insecure", help="Allow a non-loopback address without a token.")]
    = False,
    state_dir: Annotated[Path, typer.Option("--state-dir", envvar="KVCTL_STATE_DIR", help="Where snapshots go.")]
    = DEFAULT_STATE_DIR,
    snapshot_interval: Annotated[float, typer.Option("--snapshot-interval", envvar="KVCTL_SNAPSHOT_INTERVAL",
                                                     help="Seconds between snapshots.")] = 60.0,
    no_restore: Annotated[bool, typer.Option("--no-restore", help="Start empty; keep the snapshot file.")] = False,
    reset_states: Annotated[bool, typer.Option("--reset-states", help="Delete the snapshot, then start empty.")]
    = False,
    log_level: Annotated[str, typer.Option("--log-level", help="Log level (debug, info, warning, error).")]
    = "warning",
) -> None:
    from kvctl.server.daemon import ServeOptions, is_loopback, run

    host, port = parse_listen(listen)
    if block_size <= 0:
        raise UsageError(f"--block-size must be positive, got {block_size}")
    if not is_loopback(host) and not admin_token and not insecure:
        raise UsageError(f"refusing to serve on {host} without --admin-token",
                         hint="set KVCTL_ADMIN_TOKEN, or pass --insecure on a trusted network")
    engines = [parse_engine(w) for w in worker or []]
    out = Output(color=ctx.find_root().obj.color)
    if not snapshot_interval > 0:
        raise UsageError(f"--snapshot-interval must be > 0 seconds, got {snapshot_interval}")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = ServeOptions(host, port, block_size, admin_token, insecure, engines, log_level, state_dir,
                           snapshot_interval, not no_restore, reset_states)
    try:
        asyncio.run(run(options, out.line))
    except OSError as exc:
        raise UsageError(f"cannot listen on {listen}: {exc.strerror}", hint="pick another --listen port") from None
    except KeyboardInterrupt:
        pass
