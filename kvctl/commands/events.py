"""`kvctl events …`: KV events on the wire. `publish` puts RouterEvents onto a Dynamo event plane, in
Dynamo's exact encodings: the msgpack envelope on NATS Core, RouterEvent JSON on the JetStream stream."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvctl.commands._hashes import HashFormat, HashFormatOpt, hash_text, shown_hashes
from kvctl.commands._model import model_for
from kvctl.commands._nats import (
    ComponentOpt,
    ComponentScopeOpt,
    EndpointOpt,
    EndpointScopeOpt,
    NamespaceOpt,
    NatsAuth,
    with_nats_credentials,
)
from kvctl.commands._options import DryRunOpt, JsonOpt, OutputOpt, YesOpt, confirm, output_for, router_client
from kvctl.core.names import format_worker
from kvctl.core.words import counted
from kvctl.errors import KvctlError, UsageError
from kvctl.exit_codes import ExitCode
from kvctl.output import Column, Output, OutputFormat, View

if TYPE_CHECKING:
    from kvctl.core.events import RouterEvent
    from kvctl.event_taps import Tapped, TapStats

_VIEW = View(rows=lambda data: [data], name_key="subject",
             columns=[Column("published", "published", justify="right"), Column("events", "events", justify="right"),
                      Column("subject", "subject"), Column("mode", "mode"), Column("dry run", "dry_run")])

app = typer.Typer(help="KV events on the wire: tail, record, replay into a router, publish onto NATS.",
                  no_args_is_help=True)

PUBLISH_HELP = "Publish RouterEvents from a file (or -) onto a Dynamo event plane. (read-write)"
PUBLISH_EXAMPLES = (
    "Examples:\n\n"
    "  kvctl events publish dump.jsonl --nats nats://127.0.0.1:4222 --yes\n\n"
    "  kvctl tree dump -o json | kvctl events publish - --nats nats://nats:4222 --jetstream --yes"
)


@app.command("publish", help=PUBLISH_HELP, epilog=PUBLISH_EXAMPLES)
@with_nats_credentials
def publish_command(
    ctx: typer.Context,
    source: Annotated[str, typer.Argument(help="A dump (JSON list), JSONL or recorder file; - for stdin.")],
    nats_url: Annotated[str, typer.Option("--nats", envvar="KVCTL_NATS", help="nats://HOST:PORT")],
    namespace: NamespaceOpt = "dynamo",
    component: ComponentOpt = "backend",
    endpoint: EndpointOpt = "generate",
    jetstream: Annotated[bool, typer.Option("--jetstream", help="Onto the JetStream stream (RouterEvent JSON; "
                                            "the stream is created, as a worker would, when missing).")] = False,
    publisher_id: Annotated[int, typer.Option("--publisher-id", help="The envelope's publisher_id (NATS Core).")]
    = 1,
    yes: YesOpt = False,
    dry_run: DryRunOpt = False,
    nats_auth: NatsAuth | None = None,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
) -> None:
    from kvctl.commands._dump_files import file_events
    from kvctl.core.events.plane import PlaneNames

    out = output_for(ctx, output, as_json)
    assert nats_auth is not None
    conn = nats_auth(nats_url)
    if not 0 <= publisher_id < 2**64:
        raise UsageError(f"--publisher-id must be a u64, got {publisher_id}")
    events = file_events(source, None, out)
    names = PlaneNames(namespace, component, endpoint)
    subject = names.stream_subject if jetstream else names.kv_events
    summary = {"published": 0, "events": len(events), "subject": subject, "mode": "jetstream" if jetstream else "core",
               "dry_run": dry_run}
    if not dry_run:
        confirm(f"publish {counted(len(events), 'event')} to {subject} on {conn.shown_url}", yes)
        from kvctl.nats.publisher import publish

        summary["published"] = publish(conn, names, events, jetstream=jetstream, publisher_id=publisher_id)
    out.emit(summary, _VIEW)


def _event_obj(event: RouterEvent) -> dict[str, Any]:
    from kvctl.core.events.dynamo import encode_router_event_json

    return json.loads(encode_router_event_json(event))


def _describe(tapped: Tapped, hash_format: HashFormat) -> str:
    """One human line per event or gap."""
    from kvctl.core.events import Removed, Stored

    when = time.strftime("%H:%M:%S", time.localtime(tapped.received_ms / 1000))
    if tapped.event is None:
        first, last = tapped.missing or (0, 0)
        return f"{when} GAP   {first}..{last} never arrived ({last - first + 1})"
    ev, data = tapped.event, tapped.event.data
    head = f"{when} seq={tapped.seq} {format_worker(ev.worker)}"
    if isinstance(data, Stored):
        parent = "root" if data.parent_hash is None else hash_text(data.parent_hash, hash_format)
        return f"{head} stored  {counted(len(data.block_hashes), 'block')} under {parent} [{data.tier.value}]"
    if isinstance(data, Removed):
        return f"{head} removed {counted(len(data.block_hashes), 'block')} [{data.tier.value}]"
    return f"{head} cleared"


class _Until:
    """Stop after `count` events, `duration` seconds, or Ctrl-C (SIGINT or SIGTERM): what a tap checks before it
    receives the next message. What it received before is shown whole (counted as shown, never dropped after
    being counted); only `--count` stops inside a message, which may carry several events (`counted_out`)."""

    def __init__(self, count: int | None, duration: float | None) -> None:
        self.count, self.seen = count, 0
        self.deadline = None if duration is None else time.monotonic() + duration
        self.interrupted = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread (embedded): Ctrl-C is the caller's
                signal.signal(sig, self._interrupt)

    def _interrupt(self, *_: object) -> None:
        self.interrupted = True

    def counted_out(self) -> bool:
        return self.count is not None and self.seen >= self.count

    def __call__(self) -> bool:
        return (self.interrupted or self.counted_out()
                or (self.deadline is not None and time.monotonic() >= self.deadline))


def _taps(zmq_endpoint: str | None, nats_url: str | None, discovery: str | None, nats_auth: NatsAuth | None,
          scope: Any, jetstream: bool, worker_id: int, topic: str, block_size: int | None, until: _Until,
          stats: TapStats, listening: Callable[[str], None]) -> Iterator[Tapped]:
    """The events of whichever source was named (exactly one); `listening` hears when the tap is live."""
    from kvctl.errors import DiscoveryError
    from kvctl.event_taps import tap_dynamo_zmq, tap_zmq
    from kvctl.server.plane.dynamo_discovery import open_discovery

    if [zmq_endpoint, nats_url, discovery].count(None) != 2:
        raise UsageError("give exactly one source: --zmq tcp://HOST:PORT, --nats nats://HOST:PORT or "
                         "--dynamo-discovery file:DIR|etcd:URL|kubernetes[:NAMESPACE]")
    if zmq_endpoint is not None:
        if not zmq_endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise UsageError(f"--zmq wants an endpoint like tcp://HOST:5557, got {zmq_endpoint!r}")
        yield from tap_zmq(zmq_endpoint, stop=until, stats=stats, topic=topic, worker_id=worker_id,
                           block_size=block_size, listening=listening)
        return
    if discovery is not None:
        if jetstream:
            raise UsageError("--jetstream needs --nats URL (Dynamo's ZMQ event plane keeps no stream)")
        try:
            open_discovery(discovery)
        except (ValueError, DiscoveryError) as exc:
            raise UsageError(str(exc)) from None
        yield from _run_async(tap_dynamo_zmq(discovery, scope, stop=until, stats=stats, listening=listening))
        return
    from kvctl.nats.tap import tap_nats

    assert nats_url is not None
    assert nats_auth is not None
    yield from _run_async(tap_nats(nats_auth(nats_url), scope, stop=until, stats=stats, jetstream=jetstream,
                                   listening=listening))


def _run_async(agen: AsyncGenerator[Tapped, None]) -> Iterator[Tapped]:
    """An asynchronous tap's events, for the synchronous commands: each one as it comes."""
    import asyncio

    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                yield loop.run_until_complete(agen.__anext__())
            except StopAsyncIteration:
                return
    finally:
        loop.run_until_complete(agen.aclose())
        loop.close()


SourceZmq = Annotated[str | None, typer.Option("--zmq", show_default=False, help="An engine's PUB endpoint.")]
SourceNats = Annotated[str | None, typer.Option("--nats", show_default=False, help="A Dynamo event plane.")]
SourceDiscovery = Annotated[str | None, typer.Option(
    "--dynamo-discovery", show_default=False,
    help="A default Dynamo fleet's ZMQ event plane, found in its discovery store: file:DIR, etcd:URL or "
         "kubernetes[:NAMESPACE] (through KUBECONFIG or the pod's service account).")]
JetStreamOpt = Annotated[bool, typer.Option("--jetstream", help="NATS: the JetStream stream's JSON instead.")]
WorkerIdOpt = Annotated[int, typer.Option("--worker-id", help="ZMQ: the worker id to give the events.")]
TopicOpt = Annotated[str, typer.Option("--topic", help="ZMQ topic filter.")]
BlockSizeOpt = Annotated[int | None, typer.Option("--block-size", "-b", show_default=False,
                                                  help="ZMQ: for events that carry none.")]
CountOpt = Annotated[int | None, typer.Option("--count", "-n", show_default=False, help="Stop after N events.")]
DurationOpt = Annotated[float | None, typer.Option("--duration", "-d", show_default=False,
                                                  help="Stop after S seconds.")]


@app.command("tail", help="Decode KV events live from an engine (--zmq) or an event plane (--nats, or "
                          "--dynamo-discovery for Dynamo's default ZMQ plane): one line per event, gaps shown, "
                          "counters on exit. No router needed. (read-only)")
@with_nats_credentials
def tail_command(
    ctx: typer.Context, zmq_endpoint: SourceZmq = None, nats_url: SourceNats = None,
    discovery: SourceDiscovery = None,
    namespace: NamespaceOpt = "dynamo", component: ComponentScopeOpt = None, endpoint: EndpointScopeOpt = None,
    jetstream: JetStreamOpt = False,
    worker_id: WorkerIdOpt = 0, topic: TopicOpt = "", block_size: BlockSizeOpt = None, count: CountOpt = None,
    duration: DurationOpt = None, nats_auth: NatsAuth | None = None, hash_format: HashFormatOpt = HashFormat.dec,
    output: OutputOpt = None, as_json: JsonOpt = False,
) -> None:
    from kvctl.core.events.plane import PlaneScope
    from kvctl.event_taps import TapStats

    out = output_for(ctx, output, as_json)
    until, stats = _Until(count, duration), TapStats()
    scope = PlaneScope(namespace, component, endpoint)
    for tapped in _taps(zmq_endpoint, nats_url, discovery, nats_auth, scope, jetstream, worker_id, topic, block_size,
                        until, stats, out.note):
        if out.format is OutputFormat.json:
            out.line(json.dumps({"timestamp": tapped.received_ms, "seq": tapped.seq, "missing": tapped.missing,
                                 "event": None if tapped.event is None
                                 else shown_hashes(_event_obj(tapped.event), hash_format)}))
        else:
            out.line(_describe(tapped, hash_format))
        until.seen += tapped.event is not None
        if until.counted_out():  # closes the tap at this event: it counts no event it did not hand over
            break
    out.note(f"{counted(stats.messages, 'message')}, {counted(stats.events, 'event')}, "
             f"{counted(stats.gaps, 'gap')} ({stats.missing} missing), "
             f"decode errors {dict(stats.decode_errors) or 'none'}")
    _nothing_received(out, stats, zmq_endpoint, nats_url, topic, jetstream)


@app.command("record", help="Record KV events from an engine or an event plane to JSONL in Dynamo's recorder "
                            "shape ({\"timestamp\": ms, \"event\": RouterEvent}). (read-only)")
@with_nats_credentials
def record_command(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="Where to write (appended to): the file `replay` then reads.",
                                         show_default=False)],
    zmq_endpoint: SourceZmq = None, nats_url: SourceNats = None, discovery: SourceDiscovery = None,
    namespace: NamespaceOpt = "dynamo", component: ComponentScopeOpt = None, endpoint: EndpointScopeOpt = None,
    jetstream: JetStreamOpt = False,
    worker_id: WorkerIdOpt = 0, topic: TopicOpt = "", block_size: BlockSizeOpt = None, count: CountOpt = None,
    duration: DurationOpt = None, nats_auth: NatsAuth | None = None, hash_format: HashFormatOpt = HashFormat.dec,
    output: OutputOpt = None, as_json: JsonOpt = False,
) -> None:
    from kvctl.core.events.plane import PlaneScope
    from kvctl.event_taps import TapStats

    out = output_for(ctx, output, as_json)
    until, stats = _Until(count, duration), TapStats()
    try:
        sink = file.open("a")
    except OSError as exc:
        raise UsageError(f"cannot write {file}: {exc.strerror}") from None
    with sink:
        for tapped in _taps(zmq_endpoint, nats_url, discovery, nats_auth, PlaneScope(namespace, component, endpoint),
                            jetstream, worker_id, topic, block_size, until, stats, out.note):
            if tapped.event is not None:
                sink.write(json.dumps({"timestamp": tapped.received_ms, "event": _event_obj(tapped.event)}) + "\n")
                sink.flush()
                until.seen += 1
                if until.counted_out():
                    break
    out.emit({"file": str(file), **stats.as_dict()}, _RECORD_VIEW)
    _nothing_received(out, stats, zmq_endpoint, nats_url, topic, jetstream)


def _nothing_received(out: Output, stats: TapStats, zmq_endpoint: str | None, nats_url: str | None, topic: str,
                      jetstream: bool) -> None:
    """A tap that heard nothing exits 4 with the likely causes: neither ZMQ nor NATS says when nobody publishes
    (a SUB connects to a port nobody binds without an error), so silence is all there is to go on."""
    if stats.messages:
        return
    if zmq_endpoint is not None:
        causes = [f"nothing publishes at {zmq_endpoint} (wrong host or port?)",
                  "the engine publishes no KV events (vLLM: --kv-events-config with enable_kv_cache_events; "
                  "SGLang: --kv-events-config)"]
        causes += [f"no message starts with --topic {topic!r}"] if topic else []
    elif nats_url is not None:
        causes = ["no worker publishes under this --namespace/--component/--endpoint",
                  "the workers publish on NATS Core, not JetStream (drop --jetstream)" if jetstream else
                  "the fleet's events go to its JetStream stream (add --jetstream)"]
    elif not stats.publishers:
        causes = ["no publisher of this --namespace/--component/--endpoint is registered in the discovery store "
                  "(do the workers register in this store, under this namespace?)"]
    else:
        causes = [f"the {counted(stats.publishers, 'publisher')} found published nothing: an engine publishes only "
                  "when its cache changes (send it a request)", "the store names addresses this host cannot reach"]
    out.warn("received nothing: " + "; or ".join(causes))
    raise typer.Exit(ExitCode.NOTHING_RECEIVED)


_RECORD_VIEW = View(rows=lambda data: [data], name_key="file",
                    columns=[Column("file", "file"), Column("events", "events", justify="right"),
                             Column("messages", "messages", justify="right"), Column("gaps", "gaps", justify="right"),
                             Column("missing", "missing", justify="right")])
_REPLAY_VIEW = View(rows=lambda data: [{**data, "rejected": sum(data["rejected"].values())}], name_key="source",
                    columns=[Column("source", "source"), Column("sent", "sent", justify="right"),
                             Column("applied", "applied", justify="right"),
                             Column("rejected", "rejected", justify="right")])
_REJECTED_VIEW = View(rows=lambda data: [{"reason": k, "events": n} for k, n in sorted(data["rejected"].items())],
                      name_key="reason", title="rejected",
                      columns=[Column("reason", "reason"), Column("events", "events", justify="right")])
# The index's answers to an event whose blocks it lacks: what a recording cut off at its start gets.
_MID_STREAM = frozenset({"parent_block_not_found", "block_not_found"})


@app.command("replay", help="Send recorded (or dumped) events into a router's index, at their recorded pace "
                            "times --speed (0: all at once). (read-write)")
def replay_command(
    ctx: typer.Context,
    source: Annotated[str, typer.Argument(help="A recorder, JSONL or dump file; - for stdin.")],
    speed: Annotated[float, typer.Option("--speed", help="Pace multiplier for recorded timestamps; 0: no "
                                                         "waiting.")] = 0.0,
    model: Annotated[str | None, typer.Option("--model", "-m", show_default=False,
                                              help="The router's model (default: as for every command).")] = None,
    allow_partial: Annotated[bool, typer.Option(
        "--allow-partial", help="Exit 0 when some events were rejected (a warning instead), as long as one "
                                "applied; without it any rejection exits 1.")] = False,
    yes: YesOpt = False,
    dry_run: DryRunOpt = False,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
) -> None:
    from kvctl.client import calls
    from kvctl.core.events.dump_file import DumpFileError, read_timed_events
    from kvctl.output.progress import ProgressLine

    out = output_for(ctx, output, as_json)
    if speed < 0:
        raise UsageError(f"--speed must be >= 0, got {speed}")
    try:
        timed = read_timed_events(sys.stdin.read() if source == "-" else Path(source).read_text())
    except OSError as exc:
        raise UsageError(f"cannot read {source}: {exc.strerror}") from None
    except DumpFileError as exc:
        raise UsageError(f"{source}: {exc}") from None
    summary: dict[str, Any] = {"source": source, "sent": 0, "applied": 0, "rejected": {}, "dry_run": dry_run}
    if dry_run:
        summary["would_send"] = _foretold(timed, speed)
        would = summary["would_send"]
        out.note(f"dry run, nothing sent: would send {counted(would['events'], 'event')} of "
                 f"{counted(len(would['workers']), 'worker')} ({', '.join(would['workers'][:8]) or 'none'}) over "
                 f"{would['seconds']:g} s at --speed {speed:g}")
    if not dry_run and timed:
        confirm(f"replay {counted(len(timed), 'event')} into {f'model {model!r} of ' if model else ''}the router's "
                "index", yes)
        model = model_for(ctx, out, model)
        with router_client(ctx) as client, ProgressLine(out, "applied {task.fields[applied]}  rejected "
                                                             "{task.fields[rejected]}") as line:
            row = line.task(f"replay {Path(source).name}", len(timed), applied=0, rejected=0)
            for batch in _paced(timed, speed):
                answer = client.send(calls.post_events([_event_obj(e) for e in batch], model))
                summary["sent"] += len(batch)
                summary["applied"] += answer.applied
                for kind, n in answer.rejected.items():
                    summary["rejected"][kind] = summary["rejected"].get(kind, 0) + n
                line.update(row, summary["sent"], applied=summary["applied"],
                            rejected=sum(summary["rejected"].values()))
    out.emit(summary, _REPLAY_VIEW)
    if summary["rejected"] and out.format in (OutputFormat.table, OutputFormat.wide):
        out.emit(summary, _REJECTED_VIEW)
    _judge_replay(out, summary, allow_partial)


def _foretold(timed: list[tuple[int | None, RouterEvent]], speed: float) -> dict[str, Any]:
    """What a replay would send: its events, their workers, and how long the pacing would take."""
    stamps = [ms for ms, _ in timed if ms is not None]
    span_s = (max(stamps) - min(stamps)) / 1000 if stamps and speed else 0.0
    return {"events": len(timed), "workers": [format_worker(w) for w in sorted({e.worker for _, e in timed})],
            "seconds": round(span_s / speed, 3) if speed else 0.0}


def _judge_replay(out: Output, summary: dict[str, Any], allow_partial: bool) -> None:
    """Rejected events are an error (exit 1): a replay that silently lost part of its recording leaves an index
    unlike the engine's. The hint names the usual cause, a recording that starts mid-stream."""
    rejected = sum(summary["rejected"].values())
    if not rejected:
        return
    message = f"{summary['applied']} of {summary['sent']} events applied, {rejected} rejected"
    if allow_partial and summary["applied"]:
        out.warn(message)
        return
    partial = ["pass --allow-partial"] if summary["applied"] else []  # it cannot help when nothing applied
    if _MID_STREAM & set(summary["rejected"]):
        fixes = ["record from the engine's start", "replay onto a router that already holds the prefix", *partial]
        hint = ("the recording starts mid-stream: its first events' parent blocks are not in the router's index; "
                f"{', '.join(fixes[:-1])} or {fixes[-1]}")
    else:
        hint = "; ".join(["the reasons are in the output", *partial])
    raise KvctlError(message, hint=hint)


def _paced(timed: list[tuple[int | None, RouterEvent]], speed: float, batch: int = 1000) -> Iterator[
        list[RouterEvent]]:
    """Batches of events, each sent when its first event's recorded time (scaled by `speed`) comes."""
    start, first_ts = time.monotonic(), next((ts for ts, _ in timed if ts is not None), None)
    pending: list[RouterEvent] = []
    due: float | None = None
    for ts, event in timed:
        at = None if speed == 0 or ts is None or first_ts is None else (ts - first_ts) / 1000 / speed
        if pending and (len(pending) >= batch or (at is not None and due is not None and at > due)):
            yield pending
            pending = []
        if not pending:
            due = at
            if at is not None:
                time.sleep(max(0.0, start + at - time.monotonic()))
        pending.append(event)
    if pending:
        yield pending
