"""`kvctl events …`: KV events on the wire. `publish` puts RouterEvents onto a Dynamo event plane, in
Dynamo's exact encodings: the msgpack envelope on NATS Core, RouterEvent JSON on the JetStream stream."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from kvctl.commands._nats import (
    ComponentOpt,
    ConnectTimeoutOpt,
    CredsOpt,
    NamespaceOpt,
    NkeyOpt,
    PasswordOpt,
    TlsCaOpt,
    TlsCertOpt,
    TlsKeyOpt,
    TokenOpt,
    UserOpt,
    connection,
)
from kvctl.commands._options import DryRunOpt, JsonOpt, OutputOpt, YesOpt, confirm, output_for
from kvctl.errors import UsageError
from kvctl.output import Column, View

_VIEW = View(rows=lambda data: [data], name_key="subject",
             columns=[Column("published", "published", justify="right"), Column("events", "events", justify="right"),
                      Column("subject", "subject"), Column("mode", "mode"), Column("dry run", "dry_run")])

app = typer.Typer(help="KV events on the wire: publish (more to come).", no_args_is_help=True)

PUBLISH_HELP = "Publish RouterEvents from a file (or -) onto a Dynamo event plane. [read-write]"
PUBLISH_EXAMPLES = (
    "Examples:\n\n"
    "  kvctl events publish dump.jsonl --nats nats://127.0.0.1:4222 --yes\n\n"
    "  kvctl tree dump -o json | kvctl events publish - --nats nats://nats:4222 --jetstream --yes"
)


@app.command("publish", help=PUBLISH_HELP, epilog=PUBLISH_EXAMPLES)
def publish_command(
    ctx: typer.Context,
    source: Annotated[str, typer.Argument(help="A dump (JSON list), JSONL or recorder file; - for stdin.")],
    nats_url: Annotated[str, typer.Option("--nats", envvar="KVCTL_NATS", help="nats://HOST:PORT")],
    namespace: NamespaceOpt = "dynamo",
    component: ComponentOpt = "backend",
    jetstream: Annotated[bool, typer.Option("--jetstream", help="Onto the JetStream stream (RouterEvent JSON; "
                                            "the stream is created, as a worker would, when missing).")] = False,
    publisher_id: Annotated[int, typer.Option("--publisher-id", help="The envelope's publisher_id (NATS Core).")]
    = 1,
    yes: YesOpt = False,
    dry_run: DryRunOpt = False,
    nats_user: UserOpt = None,
    nats_password: PasswordOpt = None,
    nats_token: TokenOpt = None,
    nats_creds: CredsOpt = None,
    nats_nkey: NkeyOpt = None,
    nats_tls_ca: TlsCaOpt = None,
    nats_tls_cert: TlsCertOpt = None,
    nats_tls_key: TlsKeyOpt = None,
    nats_connect_timeout: ConnectTimeoutOpt = 5.0,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
) -> None:
    from kvctl.core.events.dump_file import DumpFileError, read_router_events
    from kvctl.core.events.plane import PlaneNames

    out = output_for(ctx, output, as_json)
    conn = connection(nats_url, nats_user, nats_password, nats_token, nats_creds, nats_nkey, nats_tls_ca,
                      nats_tls_cert, nats_tls_key, nats_connect_timeout)
    if not 0 <= publisher_id < 2**64:
        raise UsageError(f"--publisher-id must be a u64, got {publisher_id}")
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text()
    except OSError as exc:
        raise UsageError(f"cannot read {source}: {exc.strerror}") from None
    try:
        events = read_router_events(text)
    except DumpFileError as exc:
        raise UsageError(f"{source}: {exc}") from None
    names = PlaneNames(namespace, component)
    subject = names.stream_subject if jetstream else names.kv_events
    summary = {"published": 0, "events": len(events), "subject": subject, "mode": "jetstream" if jetstream else "core",
               "dry_run": dry_run}
    if not dry_run:
        confirm(f"publish {len(events)} events to {subject} on {nats_url}", yes)
        from kvctl.plane_publisher import publish

        summary["published"] = publish(conn, names, events, jetstream=jetstream, publisher_id=publisher_id)
    out.emit(summary, _VIEW)
