"""Hostile dumps for `kvctl tree dump|diff|stats`: dump files, what a kvctl router or a Dynamo indexer answers, and
`kvctl tree diff A B` itself.

A dump that cannot be read raises only `DumpFileError` saying where (the CLI: exit 2 with one line, no traceback);
one that can is diffed and summarised without error, and diffs equal to itself.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvctl.cli import app
from kvctl.client import sources
from kvctl.core.events import DecodeError, RouterEvent, decode_router_event_json
from kvctl.core.events.dump_file import DumpFileError, iter_dump_events, read_router_events
from kvctl.core.tree_diff import diff_events, tree_stats
from kvctl.errors import KvctlError
from kvctl.exit_codes import ExitCode
from tests.fixtures_path import FIXTURES
from tests.fuzz.junk import DEPTHS, JSON_JUNK, NAMES, deep_json, mutated

DUMP_FILE = FIXTURES / "dynamo-1.6.1" / "dump.jsonl"
LINES = DUMP_FILE.read_text().splitlines()
OBJECTS = [json.loads(line) for line in LINES]
EVENTS = read_router_events(DUMP_FILE.read_text())

_object = st.sampled_from(OBJECTS).flatmap(lambda o: mutated(o, JSON_JUNK)) | st.sampled_from(OBJECTS) | JSON_JUNK
_objects = st.lists(_object, min_size=1, max_size=8)
TEXTS = st.one_of(
    st.text(max_size=200),
    _objects.map(lambda objs: "\n".join(json.dumps(o) for o in objs)),  # JSONL (NaN, 2^64+ and all)
    _objects.map(json.dumps),  # a JSON list
    _objects.map(lambda objs: "\n".join(json.dumps({"timestamp": n, "event": o}) for n, o in enumerate(objs))),
    st.tuples(DEPTHS, st.sampled_from(["array", "map"])).map(lambda t: deep_json(*t).decode()),
    st.tuples(st.sampled_from(LINES), st.text(alphabet="[]{}\",:0123456789 \n", max_size=30)).map("".join),
    st.dictionaries(NAMES, JSON_JUNK, max_size=4).map(json.dumps),
)
WHERE = re.compile(r"^(not a JSON list of RouterEvents|line \d+|item \d+)")


def _read(text: str) -> list[Any] | None:
    try:
        return read_router_events(text)
    except DumpFileError as exc:
        assert WHERE.match(str(exc)), str(exc)
        return None


@settings(max_examples=400, deadline=None)
@given(TEXTS)
@example("[" * 100_000)
@example('{"worker_id": 1, "event": ' * 50_000)
@example(LINES[0] + "\n" + "[" * 100_000)
@example("[NaN, Infinity]")
@example('{"event": 5}')
def test_a_dump_reads_or_says_where_it_is_wrong(text: str) -> None:
    events = _read(text)
    if events is None:
        return
    diff = diff_events(events, EVENTS)
    diff.to_dict(5)
    assert diff_events(events, events).equal
    tree_stats(events, top=3)


# ----- the CLI ---------------------------------------------------------------------------------------------

_BYTES = st.one_of(TEXTS.map(str.encode), st.binary(max_size=200),
                   st.sampled_from(LINES).map(lambda line: line.encode() + b"\n\xff\xfe\n"))


# tmp_path is shared by the examples on purpose: each writes its own file over the last one.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_BYTES, st.booleans())
@example(b"\xff\xfe\x00garbage", True)
@example(b"[" * 100_000, False)
def test_tree_diff_on_a_garbage_file_exits_with_one_line(tmp_path: Path, data: bytes, garbage_first: bool) -> None:
    """Text that is no dump is a usage error (2); a binary file is not a dump at all (1, issue 37)."""
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(data)
    a, b = (garbage, DUMP_FILE) if garbage_first else (DUMP_FILE, garbage)
    result = CliRunner().invoke(app, ["tree", "diff", str(a), str(b), "-o", "json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output + result.stderr
    if result.exit_code == ExitCode.OK:
        assert json.loads(result.stdout)["a"] == str(a)
        return
    try:
        data.decode("utf-8")
        expected = ExitCode.USAGE
    except UnicodeDecodeError:
        expected = ExitCode.ERROR
    assert result.exit_code == expected, (result.exit_code, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {garbage}"), result.stderr


# ----- a router's or a Dynamo indexer's dump over HTTP -----------------------------------------------------


class _Served:
    """A real HTTP server on loopback answering every GET with `body` (200, or `status`)."""

    def __init__(self) -> None:
        served = self
        self.body = b""
        self.status = 200

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self.send_response(served.status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(served.body)))
                self.end_headers()
                self.wfile.write(served.body)

            def log_message(self, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture(scope="module")
def served() -> Iterator[_Served]:
    server = _Served()
    yield server
    server.close()


_INDEXER = st.one_of(
    TEXTS,
    _objects.map(lambda objs: json.dumps({"llama:0": {"events": objs}})),
    st.dictionaries(st.text(max_size=6), JSON_JUNK, max_size=3).map(json.dumps),
).map(str.encode) | st.binary(max_size=100)


@settings(max_examples=80, deadline=None)
@given(_INDEXER, st.sampled_from([200, 200, 200, 404, 500]))
@example(b"<html>proxy error</html>", 200)
@example(b"[" * 100_000, 200)
def test_router_and_dynamo_indexer_dumps_fail_only_as_kvctl_errors(served: _Served, body: bytes, status: int) -> None:
    served.body, served.status = body, status
    for read in (lambda: sources.router_events(served.url, model=None, token=None, timeout=5),
                 lambda: sources.dynamo_indexer_events(served.url, model=None, timeout=5)):
        try:
            events = read()
        except KvctlError as exc:
            assert exc.message
            continue
        assert diff_events(events, events).equal


@settings(max_examples=400, deadline=None)
@given(_object)
@example({**OBJECTS[0], "worker_id": 2**64})
@example({**OBJECTS[0], "worker_id": True})
@example({**OBJECTS[0], "event": {**OBJECTS[0]["event"], "data": {**OBJECTS[0]["event"]["data"], "x": None}}})
def test_a_dumps_stored_decodes_the_fast_way_as_the_general_way(obj: Any) -> None:
    """A dump's Stored lines go through msgspec (`dump_file._DumpedStored`): what they give, or refuse, is
    what `decode_router_event_json` gives or refuses."""
    assume(isinstance(obj, dict) and "worker_id" in obj)  # a RouterEvent's shape: the only one it tries
    try:
        expected: RouterEvent | None = decode_router_event_json(obj)
    except DecodeError:
        expected = None
    for text in (json.dumps(obj), json.dumps([obj])):  # a JSONL line, a JSON list's item
        try:
            read: list[RouterEvent] | None = list(iter_dump_events([text]))
        except DumpFileError:
            read = None
        assert read == (None if expected is None else [expected])
