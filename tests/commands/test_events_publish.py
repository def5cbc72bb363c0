"""`kvctl events publish` against a real nats-server, read back by a router's event plane."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl.cli import app
from kvctl.core.events.dump_file import read_router_events
from kvctl.core.events.plane import PlaneNames
from tests.fixtures_path import FIXTURES
from tests.nats_server import NatsServer, free_port
from tests.server.test_nats_plane import Router, expected_blocks, options
from tests.support import eventually_async

DUMP = FIXTURES / "dynamo-1.6.1" / "dump.jsonl"
EVENTS = read_router_events(DUMP.read_text())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    srv = NatsServer(tmp_path_factory.mktemp("nats"))
    yield srv
    srv.stop()


def run(*args: str, stdin: str | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args), input=stdin)
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("jetstream", [False, True])
async def test_published_events_reach_a_router(server: NatsServer, jetstream: bool) -> None:
    names = PlaneNames(f"publish{int(jetstream)}", "backend")
    async with Router(options(server, names, jetstream=jetstream)) as router:
        extra = ["--jetstream"] if jetstream else []
        code, out, err = await asyncio.to_thread(  # the command runs its own loop, as from a shell
            run, "events", "publish", str(DUMP), "--nats", server.url, "--namespace", names.namespace, "--yes",
            "-o", "json", *extra)
        assert code == 0, err
        summary = json.loads(out)
        assert summary["published"] == len(EVENTS)
        assert summary["subject"] == (names.stream_subject if jetstream else names.kv_events)
        # An event is counted before it is queued for the index, so the wait is for the index itself; the
        # bound is generous, as a busy machine is a normal one, and met at once on a quiet one.
        await eventually_async(lambda: router.blocks() == expected_blocks(EVENTS), "the published events indexed",
                               timeout=60)
        assert router.plane.counts["events"] == len(EVENTS)


def test_stdin_and_dry_run(server: NatsServer) -> None:
    code, out, err = run("events", "publish", "-", "--nats", server.url, "--dry-run", "-o", "json",
                         stdin=DUMP.read_text())
    assert code == 0, err
    assert json.loads(out) | {"events": len(EVENTS)} == json.loads(out) and json.loads(out)["published"] == 0


def test_no_terminal_and_no_yes_refuses(server: NatsServer) -> None:
    code, _, err = run("events", "publish", str(DUMP), "--nats", server.url)
    assert code == 2 and "--yes" in err


def test_unreachable_nats_exits_3() -> None:
    code, _, err = run("events", "publish", str(DUMP), "--nats", f"nats://127.0.0.1:{free_port()}", "--yes",
                       "--nats-connect-timeout", "1")
    assert code == 3 and "cannot reach NATS" in err


@pytest.mark.parametrize(("args", "needle"), [
    (["--nats", "http://x"], "--nats wants a URL"),
    (["--nats", "nats://127.0.0.1:1", "--publisher-id", "-1"], "--publisher-id"),
])
def test_bad_arguments_exit_2(args: list[str], needle: str) -> None:
    code, _, err = run("events", "publish", str(DUMP), *args, "--yes")
    assert code == 2 and needle in err


def test_a_bad_file_exits_2_naming_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(DUMP.read_text().splitlines()[0] + "\n{oops\n")
    code, _, err = run("events", "publish", str(bad), "--nats", "nats://127.0.0.1:1", "--yes")
    assert code == 2 and "line 2" in err
