"""Dump files in every shape read to the same events: Dynamo's dump fixture as JSONL, as a JSON list,
as recorder lines and as kvctl snapshot lines."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from kvctl.core.events.dump_file import (
    DumpFileError,
    iter_dump_events,
    iter_indexer_dump,
    read_router_events,
    read_timed_events,
)
from kvctl.core.events.dynamo import decode_router_event_json
from kvctl.core.events.plane import ActiveSequenceEvent, AddRequest, sequence_event_obj
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


def test_a_recording_with_decisions_keeps_them_in_order_and_only_replay_reads_them() -> None:
    add = ActiveSequenceEvent("req-1", 2**63 + 7, 0, AddRequest([2**64 - 1, 5], True, None, 16), 12345)
    free = ActiveSequenceEvent("req-1", 2**63 + 7, 0, "Free", 12345)
    objs = [json.loads(line) for line in LINES[:3]]
    text = "\n".join([json.dumps({"timestamp": 1, "event": objs[0]}),
                      json.dumps({"timestamp": 2, "decision": sequence_event_obj(add)}),
                      json.dumps({"timestamp": 3, "event": objs[1]}),
                      json.dumps({"decision": sequence_event_obj(free)}), json.dumps(objs[2])])
    assert read_timed_events(text) == [(1, EXPECTED[0]), (2, add), (3, EXPECTED[1]), (None, free),
                                       (None, EXPECTED[2])]
    for read in (read_router_events, lambda t: list(iter_dump_events([t]))):
        with pytest.raises(DumpFileError, match=r"^line 2 is a routing decision .*only `kvctl events replay`"):
            read(text)
    bad = json.dumps({"timestamp": 4, "decision": {**sequence_event_obj(free), "router_id": -1}})
    with pytest.raises(DumpFileError, match=r"^line 1: decision.router_id: "):
        read_timed_events(bad)


def _indexer_body(models: dict[str, list[str]]) -> tuple[str, list[int]]:
    """A Dynamo indexer's `/dump` answer of these models' event lines, and where each event ends in it."""
    body, ends = "{", []
    for m, (name, lines) in enumerate(models.items()):
        body += ("," if m else "") + json.dumps(name) + ': {"block_size": 16, "events": ['
        for n, line in enumerate(lines):
            body += ("," if n else "") + line
            ends.append(len(body))
        body += "]}"
    return body + "}", ends


def test_an_indexer_dump_is_read_a_piece_at_a_time() -> None:
    """Each event comes as soon as its piece has: a reader of the largest dump holds one event and one piece."""
    lines = (FIXTURES / "dynamo-1.6.1" / "dump.jsonl").read_text().splitlines()
    body, ends = _indexer_body({"llama:0": lines, "qwen:1": lines[:2], "empty:0": []})
    longest = max(map(len, lines))  # read ahead: at most as much again as an event cut by a piece's end
    read = 0

    def pieces() -> Iterator[str]:
        nonlocal read
        for i in range(0, len(body), 7):
            read = i + 7
            yield body[i:i + 7]

    seen: list[tuple[str, object]] = []
    for model, events in iter_indexer_dump(pieces()):
        for event in events:
            assert read - ends[len(seen)] <= longest + 7 + 2  # not much further than the piece that ends it
            seen.append((model, event))
    assert seen == [(name, item) for name, entry in json.loads(body).items() for item in entry["events"]]


@pytest.mark.parametrize(("body", "error"), [
    ('[{"worker_id": 1}]', "expected an object by model"),
    ('{"llama": 5}', "without an events list"),
    ('{"llama": {"block_size": 16}}', "without an events list"),
    ('{"llama": {"events": [{"worker_id": 1}', "never ends"),
])
def test_an_indexer_dump_that_is_not_one_says_so(body: str, error: str) -> None:
    with pytest.raises(DumpFileError, match=error):
        for _, events in iter_indexer_dump([body]):
            list(events)
