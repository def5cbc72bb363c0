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
    from kvctl.core.events.dump_file import Recorded
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
    """One human line per event, decision or gap."""
    from kvctl.core.events import Removed, Stored
    from kvctl.core.events.plane import AddRequest

    when = time.strftime("%H:%M:%S", time.localtime(tapped.received_ms / 1000))
    if (decision := tapped.decision) is not None:
        worker, action = format_worker((decision.worker_id, decision.dp_rank)), decision.action
        what = f"routed to {worker} ({counted(len(action.token_sequence or []), 'block')})" \
            if isinstance(action, AddRequest) else f"{action} on {worker}"
        return f"{when} router {decision.router_id} {what}: request {decision.request_id}"
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
          stats: TapStats, listening: Callable[[str], None], decisions: bool = False) -> Iterator[Tapped]:
    """The events (and with `decisions`, the routers' decisions) of whichever source was named (exactly one);
    `listening` hears when the tap is live."""
    from kvctl.errors import DiscoveryError
    from kvctl.event_taps import tap_dynamo_zmq, tap_zmq
    from kvctl.server.plane.dynamo_discovery import open_discovery

    if [zmq_endpoint, nats_url, discovery].count(None) != 2:
        raise UsageError("give exactly one source: --zmq tcp://HOST:PORT, --nats nats://HOST:PORT or "
                         "--dynamo-discovery file:DIR|etcd:URL|kubernetes[:NAMESPACE]")
    if decisions and (zmq_endpoint is not None or jetstream):
        raise UsageError("--decisions hears a Dynamo event plane's routers: give --nats URL (without --jetstream, "
                         "whose stream holds KV events only) or --dynamo-discovery; an engine's socket carries "
                         "no decisions")
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
        yield from _run_async(tap_dynamo_zmq(discovery, scope, stop=until, stats=stats, decisions=decisions,
                                             listening=listening))
        return
    from kvctl.nats.tap import tap_nats

    assert nats_url is not None
    assert nats_auth is not None
    yield from _run_async(tap_nats(nats_auth(nats_url), scope, stop=until, stats=stats, jetstream=jetstream,
                                   decisions=decisions, listening=listening))


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
CountOpt = Annotated[int | None, typer.Option("--count", "-n", show_default=False,
                                              help="Stop after N events (decisions included).")]
DecisionsOpt = Annotated[bool, typer.Option(
    "--decisions", help="Dynamo plane: the routers' decisions too (the active_sequences_events a frontend "
                        "publishes with --router-replica-sync): what `events replay` audits.")]
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
    duration: DurationOpt = None, decisions: DecisionsOpt = False, nats_auth: NatsAuth | None = None,
    hash_format: HashFormatOpt = HashFormat.dec, output: OutputOpt = None, as_json: JsonOpt = False,
) -> None:
    from kvctl.core.events.plane import PlaneScope
    from kvctl.event_taps import TapStats

    out = output_for(ctx, output, as_json)
    until, stats = _Until(count, duration), TapStats()
    scope = PlaneScope(namespace, component, endpoint)
    for tapped in _taps(zmq_endpoint, nats_url, discovery, nats_auth, scope, jetstream, worker_id, topic, block_size,
                        until, stats, out.note, decisions):
        if out.format is OutputFormat.json:
            out.line(json.dumps(_decision_line(tapped, hash_format) if tapped.decision is not None else {
                "timestamp": tapped.received_ms, "seq": tapped.seq, "missing": tapped.missing,
                "event": None if tapped.event is None else shown_hashes(_event_obj(tapped.event), hash_format)}))
        else:
            out.line(_describe(tapped, hash_format))
        until.seen += tapped.event is not None or tapped.decision is not None
        if until.counted_out():  # closes the tap at this event: it counts no event it did not hand over
            break
    heard = "" if stats.decisions is None else f", {counted(stats.decisions, 'decision')}"
    out.note(f"{counted(stats.messages, 'message')}, {counted(stats.events, 'event')}{heard}, "
             f"{counted(stats.gaps, 'gap')} ({stats.missing} missing), "
             f"decode errors {dict(stats.decode_errors) or 'none'}")
    _nothing_received(out, stats, zmq_endpoint, nats_url, topic, jetstream)


@app.command("record", help="Record KV events from an engine or an event plane to JSONL in Dynamo's recorder "
                            "shape ({\"timestamp\": ms, \"event\": RouterEvent}); with --decisions, the routers' "
                            "decisions between them ({\"timestamp\": ms, \"decision\": ActiveSequenceEvent}), in "
                            "the order heard. (read-only)")
@with_nats_credentials
def record_command(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="Where to write (appended to): the file `replay` then reads.",
                                         show_default=False)],
    zmq_endpoint: SourceZmq = None, nats_url: SourceNats = None, discovery: SourceDiscovery = None,
    namespace: NamespaceOpt = "dynamo", component: ComponentScopeOpt = None, endpoint: EndpointScopeOpt = None,
    jetstream: JetStreamOpt = False,
    worker_id: WorkerIdOpt = 0, topic: TopicOpt = "", block_size: BlockSizeOpt = None, count: CountOpt = None,
    duration: DurationOpt = None, decisions: DecisionsOpt = False, nats_auth: NatsAuth | None = None,
    hash_format: HashFormatOpt = HashFormat.dec, output: OutputOpt = None, as_json: JsonOpt = False,
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
                            jetstream, worker_id, topic, block_size, until, stats, out.note, decisions):
            if tapped.decision is not None:
                line = _decision_line(tapped, HashFormat.dec)
            elif tapped.event is not None:
                line = {"timestamp": tapped.received_ms, "event": _event_obj(tapped.event)}
            else:
                continue  # a gap: counted in the summary
            sink.write(json.dumps(line) + "\n")
            sink.flush()
            until.seen += 1
            if until.counted_out():
                break
    out.emit({"file": str(file), **stats.as_dict()}, _RECORD_VIEW)
    _nothing_received(out, stats, zmq_endpoint, nats_url, topic, jetstream)


def _decision_line(tapped: Tapped, hash_format: HashFormat) -> dict[str, Any]:
    """A decision as a recording keeps it: serde's JSON of the event replica sync publishes."""
    from kvctl.core.events.plane import sequence_event_obj

    assert tapped.decision is not None
    return {"timestamp": tapped.received_ms, "decision": shown_hashes(sequence_event_obj(tapped.decision),
                                                                      hash_format)}


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
                            "times --speed (0: all at once). A recording made with --decisions sends its decisions "
                            "between them, in the file's order: the router audits and books each as replica sync "
                            "would (then `kvctl audit`, and --what-if, read them). (read-write)")
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
    from kvctl.core.events.plane import ActiveSequenceEvent, sequence_event_obj
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
    decisions = sum(isinstance(item, ActiveSequenceEvent) for _, item in timed)
    summary: dict[str, Any] = {"source": source, "sent": 0, "applied": 0, "rejected": {}, "dry_run": dry_run,
                               "decisions": {"sent": 0, "audited": 0, "booked": {}, "rejected": {}}}
    if dry_run:
        summary["would_send"] = _foretold(timed, speed)
        would = summary["would_send"]
        out.note(f"dry run, nothing sent: would send {counted(would['events'], 'event')} of "
                 f"{counted(len(would['workers']), 'worker')} ({', '.join(would['workers'][:8]) or 'none'})"
                 + (f" and {counted(decisions, 'decision')}" if decisions else "")
                 + f" over {would['seconds']:g} s at --speed {speed:g}")
    if not dry_run and timed:
        what = counted(len(timed) - decisions, "event") + (f" and {counted(decisions, 'decision')}" if decisions
                                                           else "")
        confirm(f"replay {what} into {f'model {model!r} of ' if model else ''}the router's index", yes)
        model = model_for(ctx, out, model)
        heard = summary["decisions"]
        with router_client(ctx) as client, ProgressLine(out, "applied {task.fields[applied]}  rejected "
                                                             "{task.fields[rejected]}") as line:
            row = line.task(f"replay {Path(source).name}", len(timed), applied=0, rejected=0)
            for batch in _paced(timed, speed):
                objs = [sequence_event_obj(i) if isinstance(i, ActiveSequenceEvent) else _event_obj(i) for i in batch]
                if isinstance(batch[0], ActiveSequenceEvent):
                    answer = client.send(calls.post_decisions(objs, model))
                    heard["sent"] += len(batch)
                    heard["audited"] += answer.audited
                    _add_counts(heard["booked"], answer.booked)
                    _add_counts(heard["rejected"], answer.rejected)
                else:
                    applied = client.send(calls.post_events(objs, model))
                    summary["sent"] += len(batch)
                    summary["applied"] += applied.applied
                    _add_counts(summary["rejected"], applied.rejected)
                line.update(row, summary["sent"] + heard["sent"], applied=summary["applied"],
                            rejected=sum(summary["rejected"].values()) + sum(heard["rejected"].values()))
    out.emit(summary, _REPLAY_VIEW)
    if summary["rejected"] and out.format in (OutputFormat.table, OutputFormat.wide):
        out.emit(summary, _REJECTED_VIEW)
    if summary["decisions"]["sent"]:
        heard = summary["decisions"]
        booked = ", ".join(f"{kind} {n}" for kind, n in sorted(heard["booked"].items()))
        out.note(f"{counted(heard['sent'], 'decision')} heard: {heard['audited']} audited (see `kvctl audit`); "
                 f"as bookings: {booked or 'none'}")
    _judge_replay(out, summary, allow_partial)


def _add_counts(into: dict[str, int], counts: dict[str, int]) -> None:
    for kind, n in counts.items():
        into[kind] = into.get(kind, 0) + n


def _foretold(timed: list[tuple[int | None, Recorded]], speed: float) -> dict[str, Any]:
    """What a replay would send: its events, their workers, its decisions, and how long the pacing would take."""
    from kvctl.core.events import RouterEvent

    stamps = [ms for ms, _ in timed if ms is not None]
    span_s = (max(stamps) - min(stamps)) / 1000 if stamps and speed else 0.0
    events = [e for _, e in timed if isinstance(e, RouterEvent)]
    return {"events": len(events), "workers": [format_worker(w) for w in sorted({e.worker for e in events})],
            "decisions": len(timed) - len(events), "seconds": round(span_s / speed, 3) if speed else 0.0}


def _judge_replay(out: Output, summary: dict[str, Any], allow_partial: bool) -> None:
    """Rejected events are an error (exit 1): a replay that silently lost part of its recording leaves an index
    unlike the engine's. The hint names the usual cause, a recording that starts mid-stream."""
    rejected = sum(summary["rejected"].values())
    bad_decisions = sum(summary["decisions"]["rejected"].values())
    if not rejected and not bad_decisions:
        return
    message = f"{summary['applied']} of {summary['sent']} events applied, {rejected} rejected" + (
        f"; {bad_decisions} of {summary['decisions']['sent']} decisions malformed" if bad_decisions else "")
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


def _paced(timed: list[tuple[int | None, Recorded]], speed: float, batch: int = 1000) -> Iterator[list[Recorded]]:
    """Batches of events, or of decisions (a batch holds one kind: the file's order is kept across kinds), each
    sent when its first item's recorded time (scaled by `speed`) comes."""
    start, first_ts = time.monotonic(), next((ts for ts, _ in timed if ts is not None), None)
    pending: list[Recorded] = []
    due: float | None = None
    for ts, item in timed:
        at = None if speed == 0 or ts is None or first_ts is None else (ts - first_ts) / 1000 / speed
        if pending and (len(pending) >= batch or type(item) is not type(pending[0])
                        or (at is not None and due is not None and at > due)):
            yield pending
            pending = []
        if not pending:
            due = at
            if at is not None:
                time.sleep(max(0.0, start + at - time.monotonic()))
        pending.append(item)
    if pending:
        yield pending
