"""`kvctl tree diff dynamo+URL …` is order-free: a real Dynamo 1.6.1 `/dump` (its slower tiers one block an event,
in hash-map order) equals a file of the same blocks parents first, and not one without a block.

Asserts exit codes and parsed `-o json`, never prose."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvctl.cli import app
from kvctl.core.events import RouterEvent, Stored, Tier, encode_router_event_json
from tests.core.test_tree_diff import TIERS_DUMP, dynamo_dump_events, parents_first

runner = CliRunner()


@pytest.fixture
def indexer() -> Iterator[str]:
    """A loopback HTTP server answering `GET /dump` with the fixture's bytes, as Dynamo's indexer sent them."""
    body = TIERS_DUMP.encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200 if self.path == "/dump" else 404)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"dynamo+http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def dump_file(path: Path, events: list[RouterEvent]) -> str:
    path.write_bytes(b"".join(encode_router_event_json(e) + b"\n" for e in events))
    return str(path)


def diff(*args: str) -> tuple[int, dict[str, Any]]:
    result = runner.invoke(app, ["tree", "diff", *args, "-o", "json", "--exit-code"])
    return result.exit_code, json.loads(result.stdout)


def test_dynamos_unordered_dump_equals_the_same_blocks_parents_first(indexer: str, tmp_path: Path) -> None:
    ordered = dump_file(tmp_path / "ordered.jsonl", parents_first(dynamo_dump_events(TIERS_DUMP)))
    for a, b in ((indexer, ordered), (ordered, indexer), (indexer, indexer)):
        code, out = diff(a, b)
        assert code == 0 and out["equal"] is True and out["only_a"] == out["only_b"] == []
        assert {w["worker"]: (w["blocks_a"], w["blocks_b"]) for w in out["workers"]} == {
            "0:0": (37, 37), "1:1": (37, 37), "2:0": (57, 57)}  # every slower tier's 20 blocks counted


def test_a_slower_tier_block_missing_from_one_side_is_named(indexer: str, tmp_path: Path) -> None:
    events = dynamo_dump_events(TIERS_DUMP)
    last = [e for e in events if e.data.tier is Tier.disk and type(e.data) is Stored]
    leaf = next(e for e in last if not any(o.data.parent_hash == e.data.block_hashes[0] for o in last))
    code, out = diff(indexer, dump_file(tmp_path / "less.jsonl", [e for e in events if e is not leaf]))
    assert code == 1 and out["equal"] is False
    assert [(w["worker"], w["only_a"], w["only_b"]) for w in out["workers"] if w["only_a"] or w["only_b"]] == [
        ("1:1", 1, 0)]
    assert [(r["side"], r["tier"], r["depth"]) for r in out["only_a"]] == [("a", "disk", 20)]
    assert out["only_b"] == []
