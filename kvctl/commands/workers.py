"""`kvctl workers`: every (worker, dp rank) a router knows, with its cached blocks, in-flight load and busy flag.

The last event age tells a silent engine from an idle one; wide mode adds what the worker itself last
reported on the event plane (its load, and its last forward pass: requests queued and running), to compare
with the router's own view of its load. A worker an engine stream follows shows what the stream showed: its
KV cache groups (a hybrid model's: `0:full_attention 1:sliding_window(128)`) and the events it did not index,
as Dynamo 1.6.1 would not (a total; wide mode: per group and by cause, and how many cache salts it saw).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvctl.commands._options import JsonOpt, OutputOpt, output_for, router_client
from kvctl.commands._views import NAME_KEY, STREAM_COLUMNS, STREAM_WIDE_COLUMNS, WORKER_COLUMNS, stream_cells
from kvctl.commands._watch import IntervalOpt, WatchOpt, show
from kvctl.core.names import format_worker
from kvctl.errors import not_found
from kvctl.output import Column, View
from kvctl.output.words import age

if TYPE_CHECKING:
    from kvctl.http_api import Workers

HELP = ("List a router's workers: blocks held, active load, busy flag, last event age, KV cache groups, events "
        "dropped. (read-only)")
EXAMPLES = (
    "Examples:\n\n"
    "  kvctl workers\n\n"
    "  kvctl workers --model llama -o wide --watch\n\n"
    "  kvctl workers -o json | jq '.workers[] | select(.busy)'"
)


def _row(worker: dict[str, Any]) -> dict[str, Any]:
    reported = worker.get("reported") or {}
    passed = worker.get("forward_pass") or {}
    return {**worker, NAME_KEY: format_worker((worker["worker_id"], worker["dp_rank"])),
            "last_event_age": age(worker.get("last_event_age_s")) or ("restored" if worker.get("restored") else None),
            **{f"reported_{key}": value for key, value in reported.items()},
            "reported_age": age(reported.get("age_s")),
            "queued": _requests(passed, "queued"), "scheduled": _requests(passed, "scheduled"),
            "forward_pass_age": age(passed.get("age_s")), **_source(worker.get("event_plane")),
            **stream_cells(worker if "events_dropped" in worker else None, worker["dp_rank"])}


def _source(source: dict[str, Any] | None) -> dict[str, Any]:
    """Where the event plane's worker's events come from: its publisher (its address on the ZMQ plane), and
    whether a late join's recovery of its index worked."""
    if not source:
        return {}
    recovery = source.get("recovery") or {}
    return {"publisher": source.get("address") or source.get("publisher_id"),
            "recovery": recovery.get("state") if recovery.get("state") != "partial"
            else f"partial: {recovery.get('reason')}"}


def _requests(passed: dict[str, Any], kind: str) -> str | None:
    """`prefill+decode` requests of a forward pass, as the worker counted them; None without a report."""
    if not passed:
        return None
    return f"{passed[f'{kind}_prefill_requests']}+{passed[f'{kind}_decode_requests']}"


_VIEW = View(
    rows=lambda answer: [_row(w) for w in answer["workers"]],
    columns=[
        *WORKER_COLUMNS,
        Column("model", "model"),
        Column("role", "role"),
        Column("endpoint", "endpoint"),
        Column("blocks", "blocks", justify="right"),
        Column("active decode blocks", "active_decode_blocks", justify="right"),
        Column("prefill tokens", "active_prefill_tokens", justify="right"),
        Column("busy", "busy"),
        Column("last event", "last_event_age", justify="right"),
        *STREAM_COLUMNS,
        Column("requests", "active_requests", wide_only=True, justify="right"),
        Column("total blocks", "total_blocks", wide_only=True, justify="right"),
        Column("reported decode blocks", "reported_active_decode_blocks", wide_only=True, justify="right"),
        Column("reported prefill tokens", "reported_active_prefill_tokens", wide_only=True, justify="right"),
        Column("reported kv used", "reported_kv_used_blocks", wide_only=True, justify="right"),
        Column("reported", "reported_age", wide_only=True, justify="right"),
        Column("queued p+d", "queued", wide_only=True, justify="right"),
        Column("running p+d", "scheduled", wide_only=True, justify="right"),
        Column("forward pass", "forward_pass_age", wide_only=True, justify="right"),
        Column("replay endpoint", "replay_endpoint", wide_only=True),
        Column("publisher", "publisher", wide_only=True),
        Column("recovery", "recovery", wide_only=True),
        *STREAM_WIDE_COLUMNS,
    ],
    name_key=NAME_KEY,
)


def workers_command(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Only this model's workers.",
                                              show_default=False)] = None,
    watch: WatchOpt = False,
    interval: IntervalOpt = 2.0,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
) -> None:
    import msgspec

    from kvctl.client import calls

    out = output_for(ctx, output, as_json)
    with router_client(ctx) as client:

        def fetch() -> Workers:
            answer = client.send(calls.workers())
            if model is None:
                return answer
            chosen = [w for w in answer.workers if w.model == model]
            if not chosen and model not in (models := client.send(calls.status()).models):
                raise not_found("model", repr(model), client.base_url, sorted(models))
            return msgspec.structs.replace(answer, workers=chosen)

        show(out, fetch, lambda answer: out.emit(answer, _VIEW), watch=watch, interval=interval)
