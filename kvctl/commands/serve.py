"""`kvctl serve`: the router daemon. The server code is imported only when this command runs."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvctl.commands._nats import (
    PANEL,
    ComponentScopeOpt,
    EndpointScopeOpt,
    NamespaceOpt,
    NatsAuth,
    with_nats_credentials,
)
from kvctl.errors import UsageError
from kvctl.output import Output

if TYPE_CHECKING:
    from kvctl.server.state import WorkerInfo
    from kvctl.server.zmq_plane import ZmqOptions

HELP = "Run a router + KV indexer daemon: engine ZMQ events in, routing decisions out. (read-write)"
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


def parse_engine(text: str) -> WorkerInfo:
    from kvctl.server.state import WorkerInfo

    m = _ENGINE.match(text)
    if m is None:
        raise UsageError(f"--worker wants ID[:DP]=tcp://HOST:PORT[,replay=…][,model=…][,topic=…], got {text!r}")
    opts = dict(kv.split("=", 1) for kv in m["opts"].split(",") if kv)
    unknown = set(opts) - {"replay", "model", "topic"}
    if unknown:
        raise UsageError(f"--worker: unknown option {sorted(unknown)[0]!r}", hint="known: replay, model, topic")
    from kvctl.server.endpoint import check_endpoint

    if len(m["id"]) > 20 or int(m["id"]) >= 2**64 or len(m["dp"] or "") > 10 or int(m["dp"] or 0) >= 2**32:
        raise UsageError(f"--worker: the worker id is a u64 and the dp rank a u32, got {text!r}")
    try:
        for endpoint in (m["endpoint"], opts.get("replay")):
            if endpoint is not None:
                check_endpoint(endpoint)
    except ValueError as exc:
        raise UsageError(f"--worker: {exc}") from None
    return WorkerInfo(int(m["id"]), int(m["dp"] or 0), opts.get("model", "default"), endpoint=m["endpoint"],
                      replay_endpoint=opts.get("replay"), topic=opts.get("topic", ""))


def parse_tier_credits(text: str | None) -> dict | None:  # type: ignore[type-arg]
    """'default' or 'tier=credit,...' (tiers: host_pinned, disk, external)."""
    from kvctl.core.events import Tier
    from kvctl.core.router.scoring import DEFAULT_TIER_CREDITS

    if text is None:
        return None
    if text == "default":
        return dict(DEFAULT_TIER_CREDITS)
    credits = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        try:
            credits[Tier(name.strip())] = float(value)
        except ValueError:
            raise UsageError(f"--tier-credits: bad item {item!r}",
                             hint="e.g. host_pinned=0.75,disk=0.25, or 'default'") from None
    return credits


def _loop_factory():  # type: ignore[no-untyped-def]
    """uvloop where it is installed (Linux, macOS): a faster loop for the HTTP and ZMQ sides alike."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _zmq_options(discovery: str, namespace: str, component: str | None, endpoint: str | None, model: str,
                 router_id: int | None, state_dir: Path, replica_sync: bool, nats_only: bool) -> ZmqOptions:
    """`--dynamo-discovery`'s plane; --shadow and --jetstream are NATS's alone (this plane never publishes)."""
    from kvctl.server.dynamo_discovery import open_discovery
    from kvctl.server.router_id import stable_router_id
    from kvctl.server.zmq_plane import ZmqOptions

    if nats_only:
        raise UsageError("--shadow and --jetstream need --nats URL (the ZMQ event plane is only read)")
    try:
        open_discovery(discovery)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return ZmqOptions(discovery, namespace, component, endpoint, model,
                      router_id if router_id is not None else stable_router_id(state_dir), replica_sync)


@with_nats_credentials
def serve_command(
    ctx: typer.Context,
    listen: Annotated[str, typer.Option("--listen", envvar="KVCTL_LISTEN", help="HOST:PORT to bind (port 0: any).")]
    = "127.0.0.1:7433",
    block_size: Annotated[int, typer.Option("--block-size", envvar="KVCTL_BLOCK_SIZE", help="Tokens per KV block.")]
    = 16,
    config: Annotated[Path | None, typer.Option("--config", "-c", envvar="KVCTL_SERVE_CONFIG", show_default=False,
                                                help="TOML file declaring models and workers.")] = None,
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
    log_level: Annotated[str, typer.Option("--log-level", envvar="KVCTL_LOG_LEVEL",
                                           help="Log level (debug, info, warning, error).")] = "warning",
    log_format: Annotated[str, typer.Option("--log-format", envvar="KVCTL_LOG_FORMAT",
                                            help="text, or json (one object per line).")] = "text",
    overlap_score_weight: Annotated[float, typer.Option(
        "--overlap-score-weight", envvar="KVCTL_OVERLAP_SCORE_WEIGHT", help="Weight of prefill blocks in the cost.")]
    = 1.0,
    temperature: Annotated[float, typer.Option("--router-temperature", envvar="KVCTL_ROUTER_TEMPERATURE",
                                               help="0: lowest cost wins; > 0: sample a softmax.")] = 0.0,
    tier_credits: Annotated[str | None, typer.Option(
        "--tier-credits", envvar="KVCTL_TIER_CREDITS", show_default=False,
        help="Credit blocks held on slower tiers, e.g. 'host_pinned=0.75,disk=0.25' (or 'default').")] = None,
    decode_threshold: Annotated[float | None, typer.Option(
        "--active-decode-blocks-threshold", envvar="KVCTL_ACTIVE_DECODE_BLOCKS_THRESHOLD", show_default=False,
        help="Busy when KV use or active decode blocks exceed this fraction of capacity.")] = None,
    prefill_threshold: Annotated[int | None, typer.Option(
        "--active-prefill-tokens-threshold", envvar="KVCTL_ACTIVE_PREFILL_TOKENS_THRESHOLD", show_default=False,
        help="Busy above this many prompt tokens in flight.")] = None,
    prefill_frac: Annotated[float | None, typer.Option(
        "--active-prefill-tokens-threshold-frac", envvar="KVCTL_ACTIVE_PREFILL_TOKENS_THRESHOLD_FRAC",
        show_default=False, help="Busy above this multiple of max batched tokens in flight.")] = None,
    approximate: Annotated[bool, typer.Option("--approximate", envvar="KVCTL_APPROXIMATE",
                                              help="No KV events: index the router's own decisions.")] = False,
    router_ttl: Annotated[float, typer.Option("--router-ttl", envvar="KVCTL_ROUTER_TTL",
                                              help="Approximate mode: seconds a routed block is assumed cached.")]
    = 120.0,
    max_tree_size: Annotated[int, typer.Option("--max-tree-size", envvar="KVCTL_MAX_TREE_SIZE",
                                               help="Approximate mode: (worker, block) pairs kept at most.")]
    = 2**20,
    prune_target_ratio: Annotated[float, typer.Option("--prune-target-ratio", envvar="KVCTL_PRUNE_TARGET_RATIO",
                                                      help="Approximate mode: prune to this share of the cap.")]
    = 0.8,
    request_expiry: Annotated[float, typer.Option("--request-expiry", envvar="KVCTL_REQUEST_EXPIRY",
                                                  help="Force-free in-flight requests older than this (s).")]
    = 300.0,
    queue_batches: Annotated[int, typer.Option(
        "--queue-batches", envvar="KVCTL_QUEUE_BATCHES", min=1,
        help="Decoded batches a model's writer may hold; beyond, batches are dropped and counted.")] = 10_000,
    decoder: Annotated[str, typer.Option(
        "--decoder", envvar="KVCTL_DECODER",
        help="Where engine messages are received and decoded: inline (the router's own loop), process (a "
             "child beside the router: ingest on two cores, the route loop freed of most of it) or auto "
             "(process when this process may use two cores or more).")
    ] = "auto",
    max_body_bytes: Annotated[int, typer.Option(
        "--max-body-bytes", envvar="KVCTL_MAX_BODY_BYTES", min=1,
        help="Largest request body accepted; larger ones are refused with 413.")] = 64 * 1024 * 1024,
    nats_url: Annotated[str | None, typer.Option(
        "--nats", envvar="KVCTL_NATS", show_default=False, rich_help_panel=PANEL,
        help="Follow a Dynamo event plane on this NATS server (nats://HOST:PORT).")] = None,
    dynamo_discovery: Annotated[str | None, typer.Option(
        "--dynamo-discovery", envvar="KVCTL_DYNAMO_DISCOVERY", show_default=False, rich_help_panel=PANEL,
        help="Follow a Dynamo fleet's ZMQ event plane (its default), its publishers found in this discovery "
             "store: file:DIR (DYN_FILE_KV) or etcd:http://HOST:2379[,...].")] = None,
    namespace: NamespaceOpt = "dynamo",
    component: ComponentScopeOpt = None,
    endpoint: EndpointScopeOpt = None,
    nats_model: Annotated[str, typer.Option("--nats-model", envvar="KVCTL_NATS_MODEL", rich_help_panel=PANEL,
                                            help="The model the event plane's workers serve.")] = "default",
    router_id: Annotated[int | None, typer.Option(
        "--router-id", envvar="KVCTL_ROUTER_ID", show_default=False, rich_help_panel=PANEL,
        help="This router's id (u64): its JetStream consumer and replica-sync identity. Default: an id kept "
             "in the state dir.")] = None,
    shadow: Annotated[bool, typer.Option("--shadow", envvar="KVCTL_SHADOW", rich_help_panel=PANEL,
                                         help="Read-only: never publish, purge or create anything on NATS.")]
    = False,
    jetstream: Annotated[bool, typer.Option("--jetstream", envvar="KVCTL_JETSTREAM", rich_help_panel=PANEL,
                                            help="Durable mode: consume the JetStream stream, snapshot to the "
                                                 "object store.")] = False,
    snapshot_threshold: Annotated[int, typer.Option(
        "--snapshot-threshold", envvar="KVCTL_SNAPSHOT_THRESHOLD", rich_help_panel=PANEL,
        help="JetStream: snapshot and purge when the stream holds more messages than this.")] = 1_000_000,
    replica_sync: Annotated[bool, typer.Option(
        "--replica-sync", envvar="KVCTL_REPLICA_SYNC", rich_help_panel=PANEL,
        help="Share in-flight requests with the other routers (and take theirs).")] = False,
    nats_auth: NatsAuth | None = None,
) -> None:
    from kvctl.core.router.approx import ApproxConfig
    from kvctl.core.router.busy import Thresholds
    from kvctl.core.router.scoring import RouterConfig
    from kvctl.server.daemon import ServeOptions, is_loopback, run
    from kvctl.server.decoder import DECODER_MODES

    host, port = parse_listen(listen)
    if block_size <= 0:
        raise UsageError(f"--block-size must be positive, got {block_size}")
    if not is_loopback(host) and not admin_token and not insecure:
        raise UsageError(f"refusing to serve on {host} without --admin-token",
                         hint="set KVCTL_ADMIN_TOKEN, or pass --insecure on a trusted network")
    engines = [parse_engine(w) for w in worker or []]
    models = []
    if config is not None:
        from kvctl.server.config_file import ConfigFileError, load

        try:
            declared = load(config)
        except ConfigFileError as exc:
            raise UsageError(str(exc)) from None
        models, engines = declared.models, declared.workers + engines
    out = Output(color=ctx.find_root().obj.color)
    if not snapshot_interval > 0:
        raise UsageError(f"--snapshot-interval must be > 0 seconds, got {snapshot_interval}")
    if decoder not in DECODER_MODES:
        raise UsageError(f"--decoder must be one of {', '.join(DECODER_MODES)}, got {decoder!r}")
    if log_format not in ("text", "json"):
        raise UsageError(f"--log-format must be text or json, got {log_format!r}")
    if log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
        raise UsageError(f"--log-level must be debug, info, warning, error or critical, got {log_level!r}")
    from kvctl.server.logs import configure

    configure(log_level, log_format)
    try:
        router = RouterConfig(overlap_score_weight, temperature, parse_tier_credits(tier_credits))
        thresholds = Thresholds(decode_threshold, prefill_threshold, prefill_frac)
        approx = ApproxConfig(router_ttl, max_tree_size, prune_target_ratio) if approximate else None
        if not request_expiry > 0:
            raise ValueError(f"--request-expiry must be > 0 seconds, got {request_expiry}")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if nats_url is not None and dynamo_discovery is not None:
        raise UsageError("--nats and --dynamo-discovery name two event planes: give one")
    if router_id is not None and not 0 <= router_id < 2**64:
        raise UsageError(f"--router-id must be a u64, got {router_id}")
    nats = zmq_plane = None
    if nats_url is not None:
        from kvctl.server.nats_plane import NatsOptions
        from kvctl.server.router_id import stable_router_id

        if snapshot_threshold <= 0:
            raise UsageError(f"--snapshot-threshold must be positive, got {snapshot_threshold}")
        assert nats_auth is not None
        conn = nats_auth(nats_url)
        nats = NatsOptions(conn, namespace, component, endpoint, nats_model,
                           router_id if router_id is not None else stable_router_id(state_dir), shadow, jetstream,
                           snapshot_threshold, reset_states, replica_sync)
    elif dynamo_discovery is not None:
        zmq_plane = _zmq_options(dynamo_discovery, namespace, component, endpoint, nats_model, router_id, state_dir,
                                 replica_sync, shadow or jetstream)
    elif shadow or jetstream or replica_sync or component or endpoint:
        raise UsageError("--shadow, --jetstream, --replica-sync, --component and --endpoint need --nats URL")
    options = ServeOptions(host, port, block_size, admin_token, insecure, engines, log_level, state_dir,
                           snapshot_interval, not no_restore, reset_states, router, thresholds, approx,
                           request_expiry, models, nats, zmq_plane, queue_batches, max_body_bytes=max_body_bytes,
                           decoder=decoder)
    import asyncio

    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(run(options, out.line))
    except OSError as exc:
        raise UsageError(f"cannot listen on {listen}: {exc.strerror}", hint="pick another --listen port") from None
    except KeyboardInterrupt:
        pass
