"""Dump files in every shape read to the same events: Dynamo's dump fixture as JSONL, as a JSON list,
as recorder lines and as kvctl snapshot lines."""

from __future__ import annotations

import json

import pytest

from kvctl.core.events.dump_file import DumpFileError, read_router_events
from kvctl.core.events.dynamo import decode_router_event_json
from tests.fixtures_path import FIXTURES

LINES = (FIXTURES / "dynamo-1.6.1" / "dump.jsonl").read_text().splitlines()
EXPECTED = [decode_router_event_json(line) for line in LINES]


@pytest.mark.parametrize("shape", ["jsonl", "list", "recorder", "snapshot"])
def test_every_shape_reads_the_same_events(shape: str) -> None:
    objs = [json.loads(line) for line in LINES]
    text = {
        "jsonl": "\n".join(LINES) + "\n",
        "list": json.dumps(objs),
        "recorder": "\n".join(json.dumps({"timestamp": 1700000000000 + n, "event": o}) for n, o in enumerate(objs)),
        "snapshot": "\n".join(json.dumps({"model": "default", "event": o}) for o in objs),
    }[shape]
    assert read_router_events(text) == EXPECTED
    assert EXPECTED and max(e.worker_id for e in EXPECTED) >= 1


@pytest.mark.parametrize(("text", "needle"), [
    ("[1, 2", "not a JSON list"),
    (LINES[0] + "\nnot json", "line 2 is not JSON"),
    ("[42]", "item 0: expected a RouterEvent object"),
    ('{"worker_id": 1, "event": {"data": "bogus"}}', "line 1:"),
])
def test_bad_files_say_where(text: str, needle: str) -> None:
    with pytest.raises(DumpFileError, match=needle):
        read_router_events(text)
