"""`kvctl tree dump|diff|stats`: a radix index from any source, drawn, compared, summarised.

A source is a kvctl router (`http://…`, the resolved --server when left out), a Dynamo standalone
indexer (`dynamo+http://HOST:PORT`, read through its /dump), a durable router's JetStream snapshot
(`nats://HOST:PORT` with --namespace/--component) or a file (a dump: JSON list, JSONL, recorder lines;
a kvctl state dir's image, v1 to v3; `-` for stdin). Whatever the source, its events are replayed into an index first,
so every command sees content, not the shape of one dump (see `kvctl.core.tree_diff`). `stats` reads no
dump from a router (it computes them itself) and streams a dump file's or a Dynamo indexer's
(`kvctl.core.tree_stats`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvctl.commands._hashes import HashFormat, HashFormatOpt, shown_hashes
from kvctl.commands._nats import (
    ComponentOpt,
    NamespaceOpt,
    NatsAuth,
    with_nats_credentials,
)
from kvctl.commands._options import JsonOpt, OutputOpt, WorkerOpt, output_for, settings_for, worker_selector
from kvctl.commands._views import STREAM_COLUMNS, STREAM_WIDE_COLUMNS, stream_cells
from kvctl.commands._watch import IntervalOpt, WatchOpt, show
from kvctl.core.names import format_worker, parse_worker, selects
from kvctl.core.words import counted
from kvctl.errors import UsageError, not_found
from kvctl.output import Column, Output, OutputFormat, View

if TYPE_CHECKING:
    from kvctl.core.events import RouterEvent
    from kvctl.core.tree_diff import IndexContent, PathTrie, Segment

app = typer.Typer(help="A radix index from a router, a Dynamo indexer, a snapshot or a file: dump, diff, stats.",
                  no_args_is_help=True)

SOURCE_KINDS = ("http://ROUTER, dynamo+http://INDEXER, nats://HOST:PORT (a JetStream snapshot), a dump file "
                "(JSON list, JSONL, recorder lines; - for stdin) or a kvctl state dir (its image and state log, read "
                "offline)")
SourceArg = Annotated[str | None, typer.Argument(help=f"{SOURCE_KINDS}; default: the --server router.",
                                                 show_default=False)]
ModelOpt = Annotated[str | None, typer.Option(
    "--model", "-m", show_default=False,
    help="Model to read from a router (default: the context's, else the router's implied one; not for files).")]


STATS_KEYS = ("blocks", "nodes", "workers", "tiers", "paths", "depths", "shared_prefixes")
"""`tree stats`' object, whatever computed it (a router's answer also has its block size and mode). A router's
also has `streams`: what the engine stream of each of its workers showed (`GET /v1/workers`' `groups`,
`salts_seen` and `events_dropped`, by `ID:DP`), which no dump holds."""
READ_CHUNK = 1 << 16
"""Characters of a dump file read at a time when its stats are streamed."""
ROUTER_STATS_TIMEOUT_S = 120.0
"""What a router is given to answer `tree stats` when no --timeout is set (flag, KVCTL_TIMEOUT or the context): it
walks its whole index for the shape, a slice of its loop at a time (its device tree edge by edge, ~0.1 s per
million pairs; an index with slower tiers block by block, ~1 s per million), so the 5-s default could cut a large
index short. A --timeout that is set is the deadline, as for every command."""


class DumpFormat(StrEnum):
    tree = "tree"
    events = "events"
    stats = "stats"


@dataclass(frozen=True)
class Reader:
    """Reads any source into RouterEvents with the settings this command resolved once."""

    ctx: typer.Context
    out: Output
    model: str | None
    namespace: str
    component: str
    nats_auth: NatsAuth | None

    def events(self, source: str | None) -> list[RouterEvent]:
        from kvctl.client import sources

        settings = settings_for(self.ctx)
        source = source or settings.server
        if source.startswith(("http://", "https://")):
            return sources.router_events(source.rstrip("/"), model=self._router_model(source), token=settings.token,
                                         timeout=settings.timeout)
        if source.startswith(("dynamo+http://", "dynamo+https://")):
            return sources.dynamo_indexer_events(source.removeprefix("dynamo+").rstrip("/"), model=self.model,
                                                 timeout=settings.timeout)
        if source.startswith("nats://"):
            from kvctl.core.events.plane import PlaneNames
            from kvctl.nats.jetstream import snapshot_events

            assert self.nats_auth is not None
            return snapshot_events(self.nats_auth(source), PlaneNames(self.namespace, self.component))
        if "://" in source:
            raise UsageError(f"unknown source {source!r}", hint="http://, dynamo+http://, nats:// or a file path")
        return self._file(source)

    def stats(self, source: str | None, top: int) -> dict[str, Any]:
        """`tree stats` of a source: a router computes them itself; a dump file and a Dynamo indexer's dump are
        read as a stream (whole only when it is not a dump this can follow: `core.tree_stats`); other sources
        replay their dump."""
        from kvctl.client import sources

        settings = settings_for(self.ctx)
        source = source or settings.server
        streamed = None
        if source.startswith(("http://", "https://")):
            url, model = source.rstrip("/"), self._router_model(source)
            timeout = ROUTER_STATS_TIMEOUT_S if settings.sources["timeout"] == "default" else settings.timeout
            stats = sources.router_tree_stats(url, model=model, top=top, token=settings.token, timeout=timeout)
            counted = ({key: stats[key] for key in STATS_KEYS} if stats is not None
                       else self._replayed(source, top))
            return {**counted, "streams": sources.router_worker_streams(url, model=model, token=settings.token,
                                                                        timeout=settings.timeout)}
        elif source.startswith(("dynamo+http://", "dynamo+https://")):
            with sources.dynamo_indexer_stream(source.removeprefix("dynamo+").rstrip("/"), model=self.model,
                                               timeout=settings.timeout) as events:
                streamed = _streamed_stats(events, top)
        elif "://" not in source and source != "-":
            streamed = self._file_stats(source, top)
        return streamed if streamed is not None else self._replayed(source, top)

    def _replayed(self, source: str, top: int) -> dict[str, Any]:
        from kvctl.core.tree_diff import tree_stats  # the index and its replay: only where nobody computed them

        return tree_stats(self.events(source), top=top)

    def _router_model(self, url: str) -> str:
        from kvctl.commands._model import model_for

        return model_for(self.ctx, self.out, self.model, url.rstrip("/"))

    def _file_stats(self, source: str, top: int) -> dict[str, Any] | None:
        from kvctl.core.events.dump_file import DumpFileError, iter_dump_events

        try:
            with Path(source).open(encoding="utf-8") as f:
                return _streamed_stats(iter_dump_events(iter(lambda: f.read(READ_CHUNK), "")), top)
        except (OSError, UnicodeDecodeError, DumpFileError):
            return None  # the caller's whole read says what is wrong, as for every command

    def _file(self, source: str) -> list[RouterEvent]:
        from kvctl.commands._dump_files import file_events

        return file_events(source, self.model, self.out)


def _streamed_stats(events: Iterable[RouterEvent], top: int) -> dict[str, Any] | None:
    """`tree stats` of a dump read as a stream; None when it is not a dump that can be (replayed whole, then,
    as any event stream is)."""
    from kvctl.core.tree_stats import DumpStats, NotStreamable

    stats = DumpStats(top=top)
    try:
        stats.add_all(events)
        return {**stats.counts(), **stats.shape()}
    except NotStreamable:
        return None


def _emit_sections(out: Output, data: Any, views: Sequence[View]) -> None:
    """One object in json/yaml (named by the first view's rows with -o name); for people, one table per view
    that has rows (an empty section is only a header), the totals last."""
    if out.format in (OutputFormat.table, OutputFormat.wide):
        for view in views:
            if any(True for _ in view.rows(data)):
                out.emit(data, view)
    else:
        out.emit(data, views[0])


# ----- dump ------------------------------------------------------------------------------------------------

DUMP_HELP = "Show a radix index: as a tree, as RouterEvents (a dump any router loads) or as stats. (read-only)"
DUMP_EXAMPLES = (
    "Examples:\n\n"
    "  kvctl tree dump                                  # the --server router, drawn\n\n"
    "  kvctl tree dump http://router:7433 --worker 3 --depth 4\n\n"
    "  kvctl tree dump dynamo+http://indexer:8090 -o json > dump.json\n\n"
    "  kvctl tree dump dump.jsonl --format stats\n\n"
    "  kvctl tree dump -o name                          # the workers holding blocks, one ID:DP a line\n\n"
    "  kvctl tree dump -o wide                          # each node with its sequence hash"
)

# Only json/yaml emit the events through the sink (which ignores a view there); people get JSONL lines.
_EVENTS_VIEW = View(rows=lambda events: events, columns=[], name_key="worker_id")
# `-o name`, whatever --format: the worker keys holding blocks (ID:DP, what --worker takes back), as
# `tree stats -o name` and `workers -o name` print them.
_HOLDERS_VIEW = View(rows=lambda content: [{"worker": name} for name in _holders(content)], columns=[],
                     name_key="worker")


@app.command("dump", help=DUMP_HELP, epilog=DUMP_EXAMPLES)
@with_nats_credentials
def dump_command(
    ctx: typer.Context,
    source: SourceArg = None,
    model: ModelOpt = None,
    worker: WorkerOpt = None,
    fmt: Annotated[DumpFormat | None, typer.Option("--format", show_default=False,
                                                   help="tree (default), events (default with -o json) or stats.")]
    = None,
    depth: Annotated[int | None, typer.Option("--depth", min=1, show_default=False,
                                              help="Draw at most N levels of the (collapsed) tree.")] = None,
    hash_format: HashFormatOpt = HashFormat.dec,
    namespace: NamespaceOpt = "dynamo",
    component: ComponentOpt = "backend",
    nats_auth: NatsAuth | None = None,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
) -> None:
    from kvctl.core.tree_diff import content_stats, index_content

    out = output_for(ctx, output, as_json)
    machine = out.format in (OutputFormat.json, OutputFormat.yaml)
    fmt = fmt or (DumpFormat.events if machine else DumpFormat.tree)
    if fmt is DumpFormat.tree and machine:
        raise UsageError(f"--format tree is drawn for people, not -o {out.format}", hint="use --format events or stats")
    selector = worker_selector(worker)
    reader = Reader(ctx, out, model, namespace, component, nats_auth)
    everything = reader.events(source)
    events = [e for e in everything if selector is None or selects(selector, e.worker)]
    if worker is not None and not events:
        raise not_found("worker", worker, f"the index of {source or settings_for(ctx).server}",
                        [format_worker(w) for w in sorted({(e.worker_id, e.dp_rank) for e in everything})])
    content = index_content(events)
    if out.format is OutputFormat.name:
        out.emit(content, _HOLDERS_VIEW)
    elif fmt is DumpFormat.stats:
        _emit_sections(out, content_stats(content), _STATS_VIEWS)
    elif fmt is DumpFormat.events:
        _emit_events(out, content.index.dump(), hash_format)
    else:
        out.line(_draw(content, source or settings_for(ctx).server, depth, wide=out.format is OutputFormat.wide))


def _holders(content: IndexContent) -> list[str]:
    return [format_worker(w) for w, blocks in sorted(content.held.items()) if blocks]


def _emit_events(out: Output, events: list[RouterEvent], hash_format: HashFormat) -> None:
    import json

    from kvctl.core.events import encode_router_event_json

    encoded = [encode_router_event_json(e) for e in events]
    if out.format in (OutputFormat.json, OutputFormat.yaml):
        out.emit(shown_hashes([json.loads(e) for e in encoded], hash_format), _EVENTS_VIEW)
    elif encoded and hash_format is HashFormat.dec:
        out.line(b"\n".join(encoded).decode())
    elif encoded:
        out.line("\n".join(json.dumps(shown_hashes(json.loads(e), hash_format)) for e in encoded))


def _draw(content: IndexContent, title: str, depth: int | None, *, wide: bool = False) -> str:
    """The collapsed tree as text (rich's guides, no colour): what `--format tree` prints; `wide` (-o wide) adds
    each node's sequence hash, the value `kvctl hash` and the router's API name a block by."""
    from io import StringIO

    from rich.console import Console
    from rich.text import Text
    from rich.tree import Tree

    from kvctl.core.tree_diff import outline

    trie = content.trie
    workers = sum(1 for blocks in content.held.values() if blocks)
    blocks = sum(len(b) for b in content.held.values())
    root = Tree(Text(f"{title}: {counted(blocks, 'block')} held by {counted(workers, 'worker')}"))
    stack = [(root, seg) for seg in reversed(outline(content, depth))]
    while stack:
        parent, seg = stack.pop()
        node = parent.add(Text(_label(seg, trie, wide)))
        stack.extend((node, child) for child in reversed(seg.children))
    buffer = StringIO()
    Console(file=buffer, width=10_000, no_color=True, soft_wrap=True).print(root)
    return buffer.getvalue().rstrip("\n")


def _label(seg: Segment, trie: PathTrie, wide: bool) -> str:
    n = seg.blocks(trie)
    first, last = trie.depths[seg.first], trie.depths[seg.last]
    span = f"block {first}  {trie.locals[seg.first]}" if n == 1 else (
        f"blocks {first}-{last} ({n})  {trie.locals[seg.first]}…{trie.locals[seg.last]}")
    by_tier: dict[str, list[str]] = {}
    for worker, tiers in seg.holders.items():
        for tier in sorted(tiers):
            by_tier.setdefault(tier.value, []).append(format_worker(worker))
    held = "; ".join(f"{tier}: {' '.join(names)}" for tier, names in by_tier.items())
    sequence = f"  seq {trie.describe(seg.last)['sequence_hash']}" if wide else ""
    return f"{span}{sequence}  [{held}]" + (f"  (+{seg.hidden} below)" if seg.hidden else "")


# ----- diff ------------------------------------------------------------------------------------------------

DIFF_HELP = ("Compare two radix indexes block by block (by content: dump shape, event ids and engine hashes "
             "do not matter). (read-only)")
DIFF_EXAMPLES = (
    "Examples:\n\n"
    "  kvctl tree diff http://router-a:7433 http://router-b:7433 --exit-code\n\n"
    "  kvctl tree diff dynamo+http://indexer:8090 http://router:7433 --model llama\n\n"
    "  kvctl tree diff before.jsonl http://router:7433 -o json"
)

_DIFF_VIEWS = (
    View(rows=lambda d: d["workers"], name_key="worker",
         columns=[Column("worker", "worker"), Column("blocks a", "blocks_a", justify="right"),
                  Column("blocks b", "blocks_b", justify="right"), Column("only a", "only_a", justify="right"),
                  Column("only b", "only_b", justify="right")]),
    View(rows=lambda d: d["only_a"] + d["only_b"], name_key="sequence_hash", title="differing blocks",
         columns=[Column("side", "side"), Column("worker", "worker"), Column("tier", "tier"),
                  Column("depth", "depth", justify="right"), Column("local hash", "local_hash"),
                  Column("sequence hash", "sequence_hash", wide_only=True)]),
)


@app.command("diff", help=DIFF_HELP, epilog=DIFF_EXAMPLES)
@with_nats_credentials
def diff_command(
    ctx: typer.Context,
    a: Annotated[str, typer.Argument(help=f"Source A: {SOURCE_KINDS}.", show_default=False)],
    b: Annotated[str, typer.Argument(help="Source B, any kind.", show_default=False)],
    model: ModelOpt = None,
    limit: Annotated[int, typer.Option("--limit", min=0,
                                       help="Differing blocks listed per side (the counts are always complete).")]
    = 20,
    exit_code: Annotated[bool, typer.Option("--exit-code", help="Exit 1 when the indexes differ.")] = False,
    namespace: NamespaceOpt = "dynamo",
    component: ComponentOpt = "backend",
    nats_auth: NatsAuth | None = None,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
) -> None:
    from kvctl.core.tree_diff import diff_events

    out = output_for(ctx, output, as_json)
    if a == b == "-":
        raise UsageError("only one source can be stdin")
    reader = Reader(ctx, out, model, namespace, component, nats_auth)
    diff = diff_events(reader.events(a), reader.events(b))
    data = {"a": a, "b": b, **diff.to_dict(limit)}
    views = _DIFF_VIEWS if data["only_a"] or data["only_b"] else _DIFF_VIEWS[:1]
    _emit_sections(out, data, views)
    if diff.equal:
        out.note("the indexes hold the same blocks")
    elif exit_code:
        raise typer.Exit(1)


# ----- stats -----------------------------------------------------------------------------------------------

STATS_HELP = ("Size and shape of a radix index: blocks, nodes, per-worker sizes, depths, shared prefixes; a router "
              "computes them itself, a dump file or a Dynamo indexer's dump is read as a stream. (read-only)")
STATS_EXAMPLES = (
    "Examples:\n\n"
    "  kvctl tree stats\n\n"
    "  kvctl tree stats dynamo+http://indexer:8090 --top 5 -o json\n\n"
    "  kvctl tree stats --watch --interval 5\n\n"
    "  kvctl --timeout 600 tree stats http://router:7433\n\n"
    "Against a router the router computes them, a slice of its loop at a time: about a second per million "
    "(worker, block) pairs, so the router gets 120 s unless a --timeout is set (flag, KVCTL_TIMEOUT or the "
    "context), which is the deadline then, as for every command."
)

_HOLDERS_STATS_VIEW = View(rows=lambda d: [{"worker": w, "blocks": n} for w, n in d["workers"].items()],
                           name_key="worker",
                           columns=[Column("worker", "worker"), Column("blocks", "blocks", justify="right")])
# A router's holders, with what each one's engine stream showed (where one follows it): its KV cache groups and the
# events it did not index, in full with -o wide. The rows are the holders still: `-o name` names the same workers.
_STREAMS_STATS_VIEW = View(
    rows=lambda d: [{"worker": w, "blocks": n, **stream_cells(d["streams"].get(w), parse_worker(w)[1] or 0)}
                    for w, n in d["workers"].items()],
    name_key="worker",
    columns=[Column("worker", "worker"), Column("blocks", "blocks", justify="right"), *STREAM_COLUMNS,
             *STREAM_WIDE_COLUMNS])
_STATS_VIEWS = (
    _HOLDERS_STATS_VIEW,
    View(rows=lambda d: [{**r, "depths": f"{r['min']}-{r['max']}"} for r in d["depths"]], name_key="depths",
         title="depths",
         columns=[Column("depths", "depths", justify="right"), Column("blocks", "blocks", justify="right"),
                  Column("held", "held", justify="right")]),
    View(rows=lambda d: [{**r, "workers": " ".join(r["workers"])} for r in d["shared_prefixes"]],
         name_key="sequence_hash", title="shared prefixes",
         columns=[Column("holders", "holders", justify="right"), Column("depth", "depth", justify="right"),
                  Column("local hash", "local_hash"), Column("sequence hash", "sequence_hash", wide_only=True),
                  Column("workers", "workers")]),
    View(rows=lambda d: [{**d, "workers": len(d["workers"])}], name_key="blocks", title="totals",
         columns=[Column("blocks", "blocks", justify="right"), Column("nodes", "nodes", justify="right"),
                  Column("distinct", "paths", justify="right"), Column("workers", "workers", justify="right")]),
)


@app.command("stats", help=STATS_HELP, epilog=STATS_EXAMPLES)
@with_nats_credentials
def stats_command(
    ctx: typer.Context,
    source: SourceArg = None,
    model: ModelOpt = None,
    top: Annotated[int, typer.Option("--top", min=0, help="Shared prefixes listed.")] = 10,
    namespace: NamespaceOpt = "dynamo",
    component: ComponentOpt = "backend",
    nats_auth: NatsAuth | None = None,
    watch: WatchOpt = False,
    interval: IntervalOpt = 2.0,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
) -> None:
    out = output_for(ctx, output, as_json)
    if watch and source == "-":
        raise UsageError("--watch reads the source again each time; stdin can be read only once",
                         hint="give a router URL or a file")
    reader = Reader(ctx, out, model, namespace, component, nats_auth)
    show(out, lambda: reader.stats(source, top),
         lambda stats: _emit_sections(out, stats, _stats_views(stats)), watch=watch, interval=interval)


def _stats_views(stats: dict[str, Any]) -> Sequence[View]:
    """`_STATS_VIEWS`; a router's holders with their engine streams' columns (`-` where none follows one)."""
    if "streams" not in stats:
        return _STATS_VIEWS
    return (_STREAMS_STATS_VIEW, *_STATS_VIEWS[1:])
