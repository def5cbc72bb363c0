"""`kvctl busy get / set`: a model's busy thresholds, spoken in Dynamo's own `/busy_threshold` API.

Only Dynamo's calls are used to read and set (GET, and POST with the fields to merge), so both commands
work against a Dynamo frontend too. Dynamo's POST cannot clear a threshold; `--unset` uses kvctl's
`DELETE /busy_threshold`, which a Dynamo frontend does not have.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvctl.commands._options import DryRunOpt, JsonOpt, OutputOpt, YesOpt, confirm, output_for, router_client
from kvctl.commands._watch import IntervalOpt, WatchOpt, show
from kvctl.errors import ApiError, KvctlError, UsageError, there
from kvctl.output import Column, View

if TYPE_CHECKING:
    from kvctl.client import RouterClient
    from kvctl.http_api import Thresholds, ThresholdsList

app = typer.Typer(help="Busy thresholds per model (Dynamo's /busy_threshold; works against a Dynamo frontend).",
                  no_args_is_help=True)

GET_HELP = "Show the busy thresholds of every model, or of one. (read-only)"
GET_EXAMPLES = "Examples:\n\n  kvctl busy get\n\n  kvctl busy get --model llama -o json\n\n  kvctl busy get --watch"
SET_HELP = (
    "Set (merge) or unset a model's busy thresholds. (read-write)\n\n"
    "Thresholds not named keep their value, as Dynamo's POST /busy_threshold does. --unset NAME turns a "
    "check off (kvctl routers only: a Dynamo frontend cannot unset over HTTP). NAME is one of "
    "active_decode_blocks_threshold, active_prefill_tokens_threshold, active_prefill_tokens_threshold_frac."
)
SET_EXAMPLES = (
    "Examples:\n\n"
    "  kvctl busy set --model llama --active-decode-blocks-threshold 0.85 --yes\n\n"
    "  kvctl busy set --model llama --unset active_prefill_tokens_threshold --dry-run"
)

_COLUMNS = [
    Column("model", "model"),
    Column("decode blocks (frac)", "active_decode_blocks_threshold", justify="right"),
    Column("prefill tokens", "active_prefill_tokens_threshold", justify="right"),
    Column("prefill tokens (x max batch)", "active_prefill_tokens_threshold_frac", justify="right"),
]
_LIST_VIEW = View(rows=lambda answer: answer["thresholds"], columns=_COLUMNS, name_key="model")
_ONE_VIEW = View(rows=lambda thresholds: [thresholds], columns=_COLUMNS, name_key="model")

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="The model (as the router names it).")]


@app.command("get", help=GET_HELP, epilog=GET_EXAMPLES)
def get_command(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Only this model.", show_default=False)] = None,
    watch: WatchOpt = False,
    interval: IntervalOpt = 2.0,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
) -> None:
    import msgspec

    out = output_for(ctx, output, as_json)
    with router_client(ctx) as client:

        def fetch() -> ThresholdsList:
            answer = _all_thresholds(client)
            return answer if model is None else msgspec.structs.replace(answer, thresholds=[_one(answer, model)])

        show(out, fetch, lambda answer: out.emit(answer, _LIST_VIEW), watch=watch, interval=interval)


@app.command("set", help=SET_HELP, epilog=SET_EXAMPLES)
def set_command(
    ctx: typer.Context,
    model: ModelOpt,
    decode: Annotated[float | None, typer.Option(
        "--active-decode-blocks-threshold", help="Busy when this fraction [0, 1] of a worker's KV blocks is in use.",
        show_default=False)] = None,
    prefill: Annotated[int | None, typer.Option(
        "--active-prefill-tokens-threshold", help="Busy above this many prompt tokens in prefill.",
        show_default=False)] = None,
    prefill_frac: Annotated[float | None, typer.Option(
        "--active-prefill-tokens-threshold-frac", help="Busy above this many times max_num_batched_tokens in "
        "prefill.", show_default=False)] = None,
    unset: Annotated[list[str] | None, typer.Option(
        "--unset", metavar="NAME", help="Turn this threshold off (repeatable; kvctl routers only).",
        show_default=False)] = None,
    yes: YesOpt = False,
    dry_run: DryRunOpt = False,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
) -> None:
    from kvctl.client import calls
    from kvctl.core.router.busy import THRESHOLD_FIELDS

    out = output_for(ctx, output, as_json)
    changes = {name: value for name, value in zip(THRESHOLD_FIELDS, (decode, prefill, prefill_frac), strict=True)
               if value is not None}
    cleared = [_field_name(name, THRESHOLD_FIELDS) for name in unset or []]
    if not changes and not cleared:
        raise UsageError("nothing to change", hint="give a threshold option or --unset NAME")
    if set(changes) & set(cleared):
        raise UsageError(f"{sorted(set(changes) & set(cleared))[0]} is both set and unset")
    with router_client(ctx) as client:
        if dry_run:
            current = _find(_all_thresholds(client), model)
            out.note("dry run: nothing was changed")
            out.emit({**_merged(model, current, changes, cleared), "dry_run": True}, _ONE_VIEW)
            return
        _merged(model, None, changes, cleared)  # validates before asking or sending: a bad value is a usage error
        summary = "; ".join([*(f"{k}={v}" for k, v in changes.items()), *(f"unset {k}" for k in cleared)])
        confirm(f"change the busy thresholds of model {model} on {client.base_url}: {summary}", yes)
        result = client.send(calls.set_busy_thresholds(model, changes)) if changes else None
        if cleared:
            result = _unset(client, model, cleared)
    out.emit(result, _ONE_VIEW)


def _all_thresholds(client: RouterClient) -> ThresholdsList:
    from kvctl.client import calls

    return client.send(calls.busy_thresholds())


def _find(answer: ThresholdsList, model: str) -> Thresholds | None:
    """One model's thresholds out of GET /busy_threshold's list (Dynamo has no per-model GET)."""
    return next((thresholds for thresholds in answer.thresholds if thresholds.model == model), None)


def _one(answer: ThresholdsList, model: str) -> Thresholds:
    """`_find`, or an error naming the models that have thresholds."""
    if (thresholds := _find(answer, model)) is None:
        raise KvctlError(f"the router has no busy thresholds for model {model!r}",
                         hint=there("model", (t.model for t in answer.thresholds)))
    return thresholds


def _field_name(name: str, fields: tuple[str, ...]) -> str:
    """A threshold name as the API spells it; the option spelling (dashes) is accepted too."""
    normalized = name.strip().lstrip("-").replace("-", "_")
    if normalized not in fields:
        raise UsageError(f"--unset {name!r}: not a threshold", hint=f"one of {', '.join(fields)}")
    return normalized


def _merged(model: str, current: Thresholds | None, changes: dict[str, float | int],
            cleared: list[str]) -> dict[str, Any]:
    """The thresholds the router will hold after this change, worked out by the core's own merge rules
    (which also validate each value, as the server does)."""
    from kvctl.core.router import busy

    held = {} if current is None else {k: getattr(current, k) for k in busy.THRESHOLD_FIELDS}
    try:
        registry = busy.BusyThresholds(busy.Thresholds(**{k: v for k, v in held.items() if v is not None}))
        registry.set(model, **changes)
        return registry.unset(model, *cleared).as_dict(model)
    except busy.ThresholdError as exc:
        raise UsageError(str(exc), hint=f"see 'kvctl busy set --help' for {exc.field}") from None


def _unset(client: RouterClient, model: str, fields: list[str]) -> Thresholds:
    from kvctl.client import calls

    try:
        return client.send(calls.unset_busy_thresholds(model, fields))
    except ApiError as exc:
        if exc.status not in (404, 405):
            raise
        raise ApiError(exc.message, status=exc.status,
                       hint="--unset needs a kvctl router; a Dynamo frontend cannot unset a threshold over HTTP "
                            "(restart it without the flag)") from None
