"""`kvctl router reset / status`: the lever that clears a router's index, and the health of its event streams.

`status` answers the first on-call question about a router whose routing looks wrong: are its engines'
events arriving at all, and has any been lost (gaps, failed replays, restarts, decode errors)?
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvctl.commands._options import (
    DryRunOpt,
    JsonOpt,
    OutputOpt,
    WorkerOpt,
    YesOpt,
    confirm,
    output_for,
    router_client,
    worker_selector,
)
from kvctl.commands._views import NAME_KEY, WORKER_COLUMNS, counts, number
from kvctl.commands._watch import IntervalOpt, WatchOpt, show
from kvctl.core.names import WorkerSelector, format_worker, parse_worker, selects
from kvctl.errors import not_found
from kvctl.output import Column, Output, OutputFormat, View
from kvctl.output.words import age, stream_state

if TYPE_CHECKING:
    from kvctl.http_api import Cleared, Status, TreeStats

app = typer.Typer(help="Reset a router's state, or show the health of its event streams.", no_args_is_help=True)

RESET_HELP = (
    "Clear a router's index: every model, one model (--model), or one worker (--worker W or W:DP). (read-write)\n\n"
    "Prints what was cleared. --dry-run says what would be, from the tree stats, and changes nothing.\n\n"
    "Against a JetStream router, Dynamo's reset also purges the stream; kvctl serve does not expose that over "
    "HTTP yet, so this clears the in-memory index only (restart the router with --reset-states to purge)."
)
RESET_EXAMPLES = (
    "Examples:\n\n"
    "  kvctl router reset --dry-run\n\n"
    "  kvctl router reset --model llama --worker 3:1 --yes -o json"
)
STATUS_HELP = "Health of each engine event stream (and of the event plane, if any). (read-only)"
STATUS_EXAMPLES = (
    "Examples:\n\n"
    "  kvctl router status\n\n"
    "  kvctl router status --watch --interval 2 -o json | jq .streams"
)

_RESET_VIEW = View(
    rows=lambda result: [{**c, "workers": ", ".join(c["workers"]) or None} for c in result["cleared"]],
    columns=[Column("model", "model"), Column("blocks", "blocks", justify="right"), Column("workers", "workers")],
    name_key="model",
)


def _stream_row(stream: dict[str, Any]) -> dict[str, Any]:
    worker = stream["worker"]
    return {**stream, **worker, NAME_KEY: format_worker((worker["worker_id"], worker["dp_rank"])),
            "state": stream_state(stream), "decode_errors": counts(stream.get("decode_errors")),
            "events_per_s": number(stream.get("events_per_s")), "last_event_age": age(stream.get("last_event_age_s"))}


_STREAMS_VIEW = View(
    rows=lambda status: [_stream_row(s) for s in status["streams"]],
    columns=[
        *WORKER_COLUMNS,
        Column("endpoint", "endpoint"),
        Column("state", "state"),
        Column("messages", "messages", justify="right"),
        Column("gaps", "gaps", justify="right"),
        Column("replays ok", "replays_ok", justify="right"),
        Column("replays failed", "replays_failed", justify="right"),
        Column("restarts", "restarts", justify="right"),
        Column("lost", "lost_batches", justify="right"),
        Column("decode errors", "decode_errors"),
        Column("events/s", "events_per_s", justify="right"),
        Column("last event", "last_event_age", justify="right"),
        Column("replay endpoint", "replay_endpoint", wide_only=True),
        Column("batches", "batches_applied", wide_only=True, justify="right"),
        Column("duplicates", "duplicates", wide_only=True, justify="right"),
        Column("last seq", "last_seq", wide_only=True, justify="right"),
    ],
    name_key=NAME_KEY,
    title="engine streams",
)


def _plane_rows(plane: dict[str, Any]) -> list[dict[str, Any]]:
    """The event plane's block as field/value rows: one connection, so a vertical table reads best."""
    snapshot = plane.get("snapshot")
    links = plane.get("connections")
    values = {
        "transport": plane.get("transport", "nats"), "url": plane.get("url"), "mode": plane.get("mode"),
        "state": plane.get("state"), "ready": plane.get("ready"),
        "connects": plane.get("connects"), "reconnects": plane.get("reconnects"),
        "last error": plane.get("last_error"), "kv events subject": (plane.get("subjects") or {}).get("kv_events"),
        "counts": counts(plane.get("counts")), "decode errors": counts(plane.get("decode_errors")),
        "publishers": len(plane.get("publishers") or []),
        "snapshot": counts(snapshot) if isinstance(snapshot, dict) else snapshot,
    }
    losses = plane.get("losses")
    if isinstance(losses, dict):  # the NATS plane: what slow-consumer drops and lost connections cost
        values["losses"] = counts({k: v for k, v in losses.items() if isinstance(v, int) and k != "gapped_workers"})
        values["gapped workers"] = counts(losses.get("gapped"))
    if isinstance(links, list):  # Dynamo's ZMQ plane: a socket per publisher and topic
        values["sockets connected"] = f"{sum(1 for link in links if link.get('connected'))}/{len(links)}"
    return [{"field": k, "value": v} for k, v in values.items()]


_PLANE_VIEW = View(rows=_plane_rows, columns=[Column("field", "field"), Column("value", "value")],
                   name_key="field", title="event plane")
_PUBLISHERS_VIEW = View(
    rows=lambda plane: [{**p, "publisher": str(p["publisher_id"]), "scope": f"{p['component']}/{p['endpoint']}",
                         "workers": ", ".join(p.get("workers") or []) or None,
                         "last_seen": age(p.get("last_seen_age_s"))} for p in plane.get("publishers") or []],
    columns=[Column("publisher", "publisher"), Column("topic", "topic"), Column("scope", "scope"),
             Column("workers", "workers"), Column("last seq", "last_sequence", justify="right"),
             Column("gaps", "gaps", justify="right"), Column("lost", "lost", justify="right"),
             Column("restarts", "restarts", justify="right"), Column("last seen", "last_seen", justify="right"),
             Column("address", "address", wide_only=True), Column("messages", "messages", wide_only=True,
                                                                      justify="right")],
    name_key="publisher", title="event plane publishers")


def _would_clear(stats: TreeStats, selector: WorkerSelector | None) -> Cleared:
    """What POST /v1/reset would answer, worked out from GET /v1/tree/stats (device-tier blocks, as reset counts)."""
    from kvctl.http_api import Cleared, ClearedModel

    cleared = []
    for model, model_stats in stats.models.items():
        held = {key: n for key, n in model_stats.workers.items() if _selected(key, selector)}
        cleared.append(ClearedModel(model, list(held), sum(held.values())))
    return Cleared(cleared)


def _selected(key: str, selector: WorkerSelector | None) -> bool:
    """Whether the worker the router keys `ID:DP` is one that --worker (absent: every worker) names."""
    key_id, key_dp = parse_worker(key)  # the router writes every key ID:DP
    return selector is None or (key_dp is not None and selects(selector, (key_id, key_dp)))


@app.command("reset", help=RESET_HELP, epilog=RESET_EXAMPLES)
def reset_command(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Only this model (default: every model).",
                                              show_default=False)] = None,
    worker: WorkerOpt = None,
    yes: YesOpt = False,
    dry_run: DryRunOpt = False,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
) -> None:
    import msgspec

    from kvctl.client import calls

    out = output_for(ctx, output, as_json)
    selector = worker_selector(worker)
    worker_id, dp_rank = selector or (None, None)
    with router_client(ctx) as client:
        if selector is not None:
            known = [(w.worker_id, w.dp_rank) for w in client.send(calls.workers()).workers
                     if model in (None, w.model)]
            if not any(selects(selector, w) for w in known):
                raise not_found("worker", f"{worker}" + (f" in model {model!r}" if model else ""), client.base_url,
                                [format_worker(w) for w in sorted(known)])
        if dry_run:
            result = _would_clear(client.send(calls.tree_stats(model)), selector)
            out.note("dry run: nothing was cleared")
        else:
            held = f"worker {worker}'s blocks" if worker else "every block"
            confirm(f"clear {held} from the index of {f'model {model!r}' if model else 'every model'} on "
                    f"{client.base_url}", yes)
            result = client.send(calls.reset(model=model, worker_id=worker_id, dp_rank=dp_rank))
    if worker is not None and not any(c.workers for c in result.cleared):
        out.warn(f"no worker {worker} holds blocks" + (f" in model {model}" if model else ""))
    out.emit({**msgspec.to_builtins(result), "dry_run": True} if dry_run else result, _RESET_VIEW)


@app.command("status", help=STATUS_HELP, epilog=STATUS_EXAMPLES)
def status_command(
    ctx: typer.Context,
    watch: WatchOpt = False,
    interval: IntervalOpt = 2.0,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
) -> None:
    from kvctl.client import calls

    out = output_for(ctx, output, as_json)
    with router_client(ctx) as client:
        show(out, lambda: client.send(calls.status()), lambda status: _render_status(out, status),
             watch=watch, interval=interval)


def _render_status(out: Output, status: Status) -> None:
    """The whole /v1/status object in json/yaml; as tables, the streams and then the event plane's block."""
    if not status.streams and out.format in (OutputFormat.table, OutputFormat.wide):
        out.note("no engine streams: this router gets its events over HTTP or the event plane")
    out.emit(status, _STREAMS_VIEW)
    if status.event_plane and out.format in (OutputFormat.table, OutputFormat.wide):
        out.emit(status.event_plane, _PLANE_VIEW)
        if status.event_plane.get("publishers"):
            out.emit(status.event_plane, _PUBLISHERS_VIEW)
