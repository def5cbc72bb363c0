"""`kvctl route`: ask a router where a request would go and, with --explain, why.

The explanation is every candidate's cost as the router computed it (overlap per tier, the credit each
tier earned and the device credit's decay, prefill and decode blocks, logit): the way to see whether a
bad routing decision came from the cache view or the load.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvctl.commands._input import parse_hash_text, read_numbers
from kvctl.commands._model import model_for
from kvctl.commands._options import JsonOpt, OutputOpt, YesOpt, confirm, output_for, router_client, settings_for
from kvctl.commands._views import NAME_KEY, WORKER_COLUMNS, counts, number
from kvctl.commands.hash import parse_token_text
from kvctl.core.names import format_worker
from kvctl.core.words import counted
from kvctl.errors import UsageError
from kvctl.output import Column, Output, OutputFormat, View

if TYPE_CHECKING:
    from kvctl.core.tiers import Sample

HELP = (
    "Ask a router which worker a request's token ids would go to, and why. (read-only; read-write with --reserve)\n\n"
    "Token ids come from the arguments, --file, stdin, or --text with a Hugging Face --tokenizer (needs the "
    "transformers package). --reserve also records the request as in flight on the chosen worker, as a "
    "frontend does, until it is freed or expires: it shifts the router's real traffic, so it asks first "
    "(--yes, needed without a terminal), and --reserve --dry-run routes without booking anything."
)
EXAMPLES = (
    "Examples:\n\n"
    "  kvctl route --file token-ids.json --explain\n\n"
    "  kvctl hash -f ids.json -o json --hash-format str | jq -r '.local_hashes[]' | kvctl route --local-hashes\n\n"
    "  kvctl route --text 'Hello there' --tokenizer Qwen/Qwen3-0.6B --reserve --request-id r1 --yes -o json"
)


def _picks(answer: dict[str, Any]) -> list[dict[str, Any]]:
    """The answer's picks: one, or a disaggregated model's prefill pick and then its decode pick."""
    return [answer, *([answer["decode"]] if answer.get("decode") else [])]


def _decision_view(split: bool) -> View:
    """One row per pick; a disaggregated model's two rows say which pool each is from."""
    return View(
        rows=lambda answer: [{**pick, NAME_KEY: format_worker((pick["worker_id"], pick["dp_rank"]))}
                             for pick in _picks(answer)],
        columns=[*([Column("pool", "role")] if split else []), *WORKER_COLUMNS,
                 Column("overlap blocks", "overlap_blocks", justify="right"),
                 Column("required blocks", "required_blocks", justify="right"), Column("request id", "request_id"),
                 Column("reason", "reason")],
        name_key=NAME_KEY,
    )


def _candidate_rows(answer: dict[str, Any]) -> list[dict[str, Any]]:
    chosen = (answer["worker_id"], answer["dp_rank"])
    return [{**c, NAME_KEY: format_worker((c["worker_id"], c["dp_rank"])),
             "chosen": "*" if (c["worker_id"], c["dp_rank"]) == chosen else "",
             "overlap_by_tier": counts(c["overlap_by_tier"]),
             "credit_by_tier": ", ".join(f"{tier}={number(v)}" for tier, v in c["credit_by_tier"].items() if v) or None,
             **{key: number(c[key]) for key in ("prefill_blocks", "decode_blocks", "logit", "effective_overlap",
                                                "decay", "raw_prefill_blocks")}}
            for c in answer["candidates"]]


_CANDIDATE_COLUMNS = [
    Column("", "chosen"),
    *WORKER_COLUMNS,
    Column("overlap blocks", "overlap_blocks", justify="right"),
    Column("overlap by tier", "overlap_by_tier"),
    Column("credit by tier", "credit_by_tier"),
    Column("decay", "decay", justify="right"),
    Column("tree size", "tree_size", wide_only=True, justify="right"),
    Column("prefill blocks", "prefill_blocks", justify="right"),
    Column("decode blocks", "decode_blocks", justify="right"),
    Column("logit", "logit", justify="right"),
    Column("busy", "busy"),
    Column("effective overlap", "effective_overlap", wide_only=True, justify="right"),
    Column("raw prefill blocks", "raw_prefill_blocks", wide_only=True, justify="right"),
    Column("active requests", "active_requests", wide_only=True, justify="right"),
]


def _explained_view(pick: dict[str, Any]) -> View:
    """Every candidate of a pick's pool, the chosen one marked `*`, titled with the pick and its reason."""
    pool = f"{pick['role']} pool " if pick.get("role") else ""
    title = (f"{pool}routed to {format_worker((pick['worker_id'], pick['dp_rank']))}: {pick['reason']} "
             f"({pick['overlap_blocks']} of {pick['required_blocks']} blocks cached)")
    return View(rows=_candidate_rows, columns=_CANDIDATE_COLUMNS, name_key=NAME_KEY, title=title)


def route_command(
    ctx: typer.Context,
    tokens: Annotated[list[str] | None, typer.Argument(help="Token ids (or use --file, stdin or --text).",
                                                       show_default=False)] = None,
    file: Annotated[Path | None, typer.Option("--file", "-f", help="Read token ids (or hashes) from this file.",
                                              dir_okay=False)] = None,
    local_hashes: Annotated[bool, typer.Option("--local-hashes", help="The numbers are local block hashes "
                                               "(u64: decimal, \"quoted\" or 0x hex), not token ids.")] = False,
    model: Annotated[str | None, typer.Option("--model", "-m", show_default=False, help="The model to route for "
                                              "(default: the context's, else the router's; see kvctl config).")]
    = None,
    explain: Annotated[bool, typer.Option("--explain", help="Show every candidate's costs and the reason.")]
    = False,
    reserve: Annotated[bool, typer.Option("--reserve", help="Record the request as in flight on the chosen worker "
                                          "(needs --request-id).")] = False,
    request_id: Annotated[str | None, typer.Option("--request-id", help="The request's id (to free it later).",
                                                   show_default=False)] = None,
    session_id: Annotated[str | None, typer.Option("--session-id", help="The request's session (Dynamo's "
                                                   "x-dynamo-session-id): its pinned worker, with session affinity "
                                                   "on; with --reserve, pins it.", show_default=False)] = None,
    lora_name: Annotated[str | None, typer.Option("--lora-name", help="The request's LoRA adapter: its blocks "
                                                  "hash under it.", show_default=False)] = None,
    cache_salt: Annotated[str | None, typer.Option("--cache-salt", help="The request's cache salt (SGLang's "
                                                   "cache_salt, Dynamo's nvext.cache_salt): only blocks stored "
                                                   "under the same salt match.", show_default=False)] = None,
    yes: YesOpt = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="With --reserve: route, but book nothing.")] = False,
    text: Annotated[str | None, typer.Option("--text", help="A prompt to tokenize (needs --tokenizer).",
                                             show_default=False)] = None,
    tokenizer: Annotated[str | None, typer.Option("--tokenizer", help="Hugging Face tokenizer name or path for "
                                                  "--text.", show_default=False)] = None,
    metrics: Annotated[str | None, typer.Option("--metrics", help="A Dynamo frontend's /metrics: a route it would "
                                                "queue says how many requests of its class it holds now (they are "
                                                "ahead of it, with fcfs and no priorities).", show_default=False)]
    = None,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
) -> None:
    import msgspec

    from kvctl.client import calls

    out = output_for(ctx, output, as_json)
    if reserve and not request_id:
        raise UsageError("--reserve needs --request-id ID", hint="the id is how the request is freed later")
    if dry_run and not reserve:
        raise UsageError("--dry-run goes with --reserve", hint="route alone books nothing: drop --dry-run")
    if local_hashes and (cache_salt is not None or lora_name is not None):
        raise UsageError("--cache-salt and --lora-name go with token ids", hint="local hashes are hashed under "
                         "them already: drop the option, or give token ids")
    ids = _request_numbers(tokens, file, local_hashes, text, tokenizer)
    booking = reserve and not dry_run
    model = model_for(ctx, out, model)
    call = calls.route(token_ids=None if local_hashes else ids, local_hashes=ids if local_hashes else None,
                       model=model, request_id=request_id, reserve=booking, explain=explain, session_id=session_id,
                       lora_name=lora_name, cache_salt=cache_salt)
    with router_client(ctx) as client:
        if booking:
            confirm(f"book request {request_id} ({len(ids)} {'hashes' if local_hashes else 'tokens'}) as in "
                    f"flight on the worker {client.base_url} chooses for model {model}", yes)
        elif dry_run:
            out.note("dry run: nothing was reserved")
        answer = client.send(call)
    shown = {**msgspec.to_builtins(answer), "dry_run": True} if dry_run else msgspec.to_builtins(answer)
    samples = _frontend_samples(ctx, metrics) if metrics and any(p.get("queued") for p in _picks(shown)) else None
    for pick in _picks(shown):  # on stderr, whatever the format: a pick the frontend would not act on at once
        if queued := pick.get("queued"):
            _say_queued(out, pick, queued, model, samples)
    if explain and out.format in (OutputFormat.table, OutputFormat.wide):  # a table per pool picked from
        for pick in _picks(shown):
            out.emit(pick, _explained_view(pick))
    else:  # -o name prints the chosen workers only; json and yaml the answer whole
        out.emit(shown, _decision_view(split="decode" in shown))


def _frontend_samples(ctx: typer.Context, url: str) -> list[Sample]:
    """One scrape of the frontend's metrics (its router queue's gauges), with the command's timeout."""
    from kvctl.client.tier_sources import Auth, Scraper

    with Scraper([url], auth=Auth(), timeout=settings_for(ctx).timeout) as scraper:
        return scraper.scrape(scraper.urls[0])


def _say_queued(out: Output, pick: dict[str, Any], queued: dict[str, Any], model: str,
                samples: list[Sample] | None) -> None:
    """The verdict on stderr; with the frontend's metrics, how many of the request's class it holds now (added to
    the answer shown, as `frontend_pending`)."""
    from kvctl.core.doctor.frontend_queue import pending_in_class

    pool = f"{pick['role']} " if pick.get("role") else ""
    limits = [f"{queued['threshold']:g} x its max batched tokens"] if queued["threshold"] is not None else []
    limits += [counted(queued["threshold_tokens"], "token")] if queued.get("threshold_tokens") is not None else []
    policy_class = queued.get("policy_class", "default")
    place = ""
    if samples is not None:
        ahead = pending_in_class(samples, model, policy_class, "prefill" if pick.get("role") == "prefill" else
                                 "decode")
        queued["frontend_pending"] = ahead
        place = (f"; the frontend exports no router queue for model {model}, class {policy_class}" if ahead is None else
                 f"; the frontend holds {counted(ahead, 'request')} of class {policy_class} now, ahead of it with "
                 f"{queued['policy']} and no priorities" if queued["policy"] == "fcfs" else
                 f"; the frontend holds {counted(ahead, 'request')} of class {policy_class} now (wspt dispatches "
                 "the cheapest first: some may go after it)")
    out.warn(f"Dynamo's frontend would hold this request in its {pool}router queue (class {policy_class}, policy "
             f"{queued['policy']}): each of the pool's {counted(len(queued['over']), 'rank')} has more prefill "
             f"tokens in flight than {' or '.join(limits)}; the pick shown is the one it would make now{place}")


def _request_numbers(tokens: list[str] | None, file: Path | None, local_hashes: bool, text: str | None,
                     tokenizer: str | None) -> list[int]:
    """The request as token ids (or local hashes), from whichever one source was given."""
    if text is not None or tokenizer is not None:
        if text is None or tokenizer is None:
            raise UsageError("--text and --tokenizer go together", hint="e.g. --text 'Hi' --tokenizer Qwen/Qwen3-0.6B")
        if tokens or file is not None or local_hashes:
            raise UsageError("--text replaces token ids: drop the arguments, --file and --local-hashes")
        ids = _tokenize(text, tokenizer)
    elif local_hashes:
        ids = read_numbers(tokens, file, parse_hash_text, "local hashes")
    else:
        ids = read_numbers(tokens, file, parse_token_text, "token ids")
    if not ids:
        raise UsageError("the request is empty", hint="give at least one token id")
    return ids


def _tokenize(text: str, name: str) -> list[int]:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UsageError("--text needs the transformers package", hint="pip install transformers") from None
    try:
        return list(AutoTokenizer.from_pretrained(name).encode(text))
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot load tokenizer {name!r}: {exc}") from None
