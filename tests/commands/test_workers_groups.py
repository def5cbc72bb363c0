"""`kvctl workers` and `kvctl tree stats` show what each worker's engine stream showed (issue 43, "See the groups"):
its KV cache groups, the cache salts it saw (a count) and the events it did not index, by cause.

A real `kvctl serve` follows three engines publishing vLLM 0.34's own bytes for a GPT-OSS-like model
(tests/fixtures/engine-streams/vllm-0.34/v2_gptoss_g0_full_g1_swa128.jsonl, replayed on loopback ZMQ): each
stores prompt A in group 0 (full attention) and group 1 (sliding window of 128 tokens), then its sliding window
removes 12 of group 1's blocks, then it stores its sentinel in both groups. As Dynamo 1.6.1, the router indexes
group 0 only: 2 stores kept; group 1's 2 stores dropped by their own kind, its 12 removes by the kind group 1
was learned to be.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvctl.commands._views import group_detail, kv_groups, stream_cells
from tests.commands.live_router import DYNAMO, json_of, kvctl, loaded_router
from tests.interop.engine_streams import STREAMS, Publishers, Stream, key_name, kvctl_settled, load_stream
from tests.server.test_serve_process import serving
from tests.support.eventually import eventually

STREAM = STREAMS / "vllm-0.34" / "v2_gptoss_g0_full_g1_swa128.jsonl"

GROUPS = [
    {"dp_rank": 0, "group_idx": 0, "kind": "full_attention", "sliding_window": None, "block_size": 16,
     "events_kept": 2, "events_dropped": 0},
    {"dp_rank": 0, "group_idx": 1, "kind": "sliding_window", "sliding_window": 128, "block_size": 16,
     "events_kept": 0, "events_dropped": 14},
]
DROPPED = {"non_main_attention_kind": 2, "non_main_attention_group": 12}
NEW_FIELDS = {"groups", "salts_seen", "events_dropped"}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, Stream]]:
    """A router following the stream's three engines, once it has applied every message."""
    stream = load_stream(STREAM)
    publishers = Publishers(stream.keys)
    try:
        engines = [a for key, endpoint in publishers.endpoints().items()
                   for a in ("--worker", f"{key_name(key)}={endpoint}")]
        with serving(tmp_path_factory.mktemp("hybrid"), "--no-restore", *engines) as (_, client):
            eventually(lambda: publishers.joined(1), "the router subscribed on every publisher socket")
            for message in stream.messages:
                publishers.send(message)
            eventually(lambda: client.get("/v1/status").json(), "every message applied",
                       until=lambda status: kvctl_settled(status, stream.last_seq()))
            yield client, stream
    finally:
        publishers.close()


def _rows(answer: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f"{w['worker_id']}:{w['dp_rank']}": w for w in answer["workers"]}


def _aged(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: {k: v for k, v in row.items() if k != "last_event_age_s"} for name, row in rows.items()}


def test_workers_json_adds_each_worker_s_groups_salts_and_drops(hybrid: tuple[httpx.Client, Stream]) -> None:
    client, stream = hybrid
    rows = _rows(json_of(kvctl(client, "workers", "-o", "json")))
    assert set(rows) == {key_name(k) for k in stream.keys}
    for row in rows.values():
        assert row["groups"] == GROUPS and row["salts_seen"] == 0 and row["events_dropped"] == DROPPED
        assert row["blocks"] == 21  # group 0's: prompt A and the sentinel, none of group 1's removes
    # One source: the rows are the API's (but for the ages, read later), and say what `/v1/status` says of each
    # stream.
    assert _aged(rows) == _aged(_rows(client.get("/v1/workers").json()))
    for s in client.get("/v1/status").json()["streams"]:
        row = rows[f"{s['worker']['worker_id']}:{s['worker']['dp_rank']}"]
        assert (row["groups"], row["salts_seen"], row["events_dropped"]) == (
            s["groups"], s["salts_seen"], s["events_dropped"])


def test_workers_table_shows_the_groups_compact_and_wide_in_full(hybrid: tuple[httpx.Client, Stream]) -> None:
    client, _ = hybrid
    table = kvctl(client, "workers")
    assert table.exit_code == 0, table.output
    header, *lines = table.stdout.splitlines()
    assert header.split()[-3:] == ["EVENT", "GROUPS", "DROPPED"] and len(lines) == 3
    assert all(line.endswith("0:full_attention 1:sliding_window(128)       14") for line in lines), table.stdout
    assert "kept=" not in table.stdout and "non_main" not in table.stdout
    wide = kvctl(client, "workers", "-o", "wide")
    assert wide.exit_code == 0, wide.output
    assert wide.stdout.splitlines()[0].split()[-6:] == ["GROUP", "DETAIL", "SALTS", "DROPPED", "BY", "CAUSE"]
    for line in wide.stdout.splitlines()[1:]:
        assert line.endswith("0:block_size=16,kept=2,dropped=0 1:block_size=16,kept=0,dropped=14      0  "
                             "non_main_attention_group=12, non_main_attention_kind=2"), wide.stdout


def test_tree_stats_adds_the_holders_streams(hybrid: tuple[httpx.Client, Stream]) -> None:
    client, stream = hybrid
    stats = json_of(kvctl(client, "tree", "stats", "-o", "json"))
    names = {key_name(k) for k in stream.keys}
    assert stats["workers"] == dict.fromkeys(sorted(names), 21)
    assert stats["streams"] == dict.fromkeys(
        names, {"groups": GROUPS, "salts_seen": 0, "events_dropped": DROPPED})
    table = kvctl(client, "tree", "stats")
    assert table.exit_code == 0, table.output
    holders = table.stdout.split("depths\n")[0].splitlines()
    assert holders[0].split() == ["WORKER", "BLOCKS", "GROUPS", "DROPPED"]
    assert all(line.split()[1:] == ["21", "0:full_attention", "1:sliding_window(128)", "14"] for line in holders[1:])
    wide = kvctl(client, "tree", "stats", "-o", "wide")
    assert "kept=2,dropped=0" in wide.stdout and "non_main_attention_group=12" in wide.stdout
    assert sorted(kvctl(client, "tree", "stats", "-o", "name").stdout.split()) == sorted(names)


def test_without_engine_streams_nothing_is_added(tmp_path: Path) -> None:
    """A router fed over HTTP (or an event plane) has no engine stream to tell of: no new field, `-` in the columns;
    a dump file has no streams at all: no new column."""
    with loaded_router(tmp_path) as client:
        rows = json_of(kvctl(client, "workers", "-o", "json"))["workers"]
        assert rows and all(not NEW_FIELDS & set(row) for row in rows)
        header, *lines = kvctl(client, "workers").stdout.splitlines()
        assert header.split()[-2:] == ["GROUPS", "DROPPED"] and all(line.split()[-2:] == ["-", "-"] for line in lines)
        stats = json_of(kvctl(client, "tree", "stats", "-o", "json"))
        assert stats["streams"] == {}
        header, *lines = kvctl(client, "tree", "stats").stdout.split("depths\n")[0].splitlines()
        assert header.split() == ["WORKER", "BLOCKS", "GROUPS", "DROPPED"]  # a router's: the same columns always
        assert lines and all(line.split()[-2:] == ["-", "-"] for line in lines)
        from_file = kvctl(client, "tree", "stats", str(DYNAMO / "dump.jsonl")).stdout
        assert from_file.splitlines()[0].split() == ["WORKER", "BLOCKS"]


def _group(idx: int, kind: str | None, window: int | None = None, dp_rank: int = 0, block_size: int | None = 16,
           kept: int = 0, dropped: int = 0) -> dict[str, Any]:
    return {"dp_rank": dp_rank, "group_idx": idx, "kind": kind, "sliding_window": window, "block_size": block_size,
            "events_kept": kept, "events_dropped": dropped}


def test_the_groups_cell_stays_short_for_many_groups() -> None:
    """A Mamba hybrid has a group per few layers: runs of one kind collapse; a group no store named, and one of
    another DP rank than the row's (a stream whose batches name several), say so."""
    nemotron = [_group(0, "full_attention"), *(_group(i, "mamba", block_size=None) for i in range(1, 7)),
                _group(7, None), _group(0, "full_attention", dp_rank=1)]
    assert kv_groups(nemotron, 0) == "0:full_attention 1-6:mamba 7:unnamed dp1/0:full_attention"
    assert kv_groups(list(reversed(nemotron)), 0) == kv_groups(nemotron, 0)
    assert group_detail([_group(0, "full_attention", kept=3), _group(1, "mamba", block_size=None, dropped=2)], 0) == (
        "0:block_size=16,kept=3,dropped=0 1:kept=0,dropped=2")
    assert kv_groups([], 0) is None and kv_groups(None, 0) is None
    assert stream_cells(None, 0) == dict.fromkeys(("kv_groups", "group_detail", "salts", "dropped",
                                                   "dropped_by_cause"))
    assert stream_cells({"groups": [], "salts_seen": 4096, "events_dropped": {}}, 0)["salts"] == "4096+"
    assert stream_cells({"groups": [], "salts_seen": 3, "events_dropped": {}}, 0)["dropped"] == 0
