"""`kvctl top` as scripts run it (no terminal): --once, --iterations, --record/--replay, the tiers panel's
numbers, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.commands.live_router import (
    PROMPT,
    WORKERS,
    free_port_url,
    json_of,
    kvctl,
    loaded_router,
    one_line_error,
)
from tests.tiers.exporter import BY_SOURCE, QUERIES, TierExporter


def test_a_recording_replays_into_the_frames_it_recorded(tmp_path: Path) -> None:
    recording = tmp_path / "incident.jsonl"
    with loaded_router(tmp_path / "state") as client:
        result = kvctl(client, "top", "--iterations", "2", "--interval", "0.1", "--record", str(recording),
                       "-o", "json")
    assert result.exit_code == 0, result.output
    live = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(live) == 2 and {w["name"] for w in live[-1]["workers"]} == WORKERS
    assert len(recording.read_text().splitlines()) == 3  # what it is, then one poll a line

    replayed = kvctl(free_port_url(), "top", "--replay", str(recording), "--iterations", "5", "--interval", "0.01",
                     "-o", "json")
    assert replayed.exit_code == 0, replayed.output
    frames = [json.loads(line) for line in replayed.stdout.splitlines()]
    assert len(frames) == 2  # the recording ran out: no invented frames
    for got, want in zip(frames, live, strict=True):
        assert got["workers"] == want["workers"] and got["events_per_s"] == want["events_per_s"]
        assert got["router"].endswith("(replay)")


def test_tiers_panel_reads_engines_metrics_like_kvctl_tiers(tmp_path: Path) -> None:
    exporter = TierExporter()
    try:
        with loaded_router(tmp_path) as client:
            frame = json_of(kvctl(client, "top", "--once", "--interval", "1", "--metrics", exporter.url, "-o", "json"))
    finally:
        exporter.close()
    host = [t for t in frame["tiers"] if t["tier"] == "host"]
    assert len(host) == 1 and host[0]["family"].startswith("vllm:")
    assert host[0]["hit_rate"] == pytest.approx(BY_SOURCE["host"] / QUERIES, rel=0.05)
    assert frame["tiers_error"] is None


def test_without_a_terminal_it_wants_once_or_iterations() -> None:
    one_line_error(kvctl(free_port_url(), "top"), 2, "needs a terminal")
    one_line_error(kvctl(free_port_url(), "top", "--once", "--iterations", "3"), 2, "--once")


def test_a_replay_cannot_reset_or_record(tmp_path: Path) -> None:
    recording = tmp_path / "r.jsonl"
    recording.write_text('{"recording": "kvctl top recording", "version": 1, "router": "http://x"}\n')
    one_line_error(kvctl(free_port_url(), "top", "--replay", str(recording), "--admin", "--once"), 2, "--replay")
    not_one = tmp_path / "other.jsonl"
    not_one.write_text("[]\n")
    one_line_error(kvctl(free_port_url(), "top", "--replay", str(not_one), "--once"), 2, "not a `kvctl top --record`")


def test_once_against_no_router_exits_3() -> None:
    one_line_error(kvctl(free_port_url(), "top", "--once", "--interval", "0.01"), 3, "cannot reach")


def test_once_shows_the_routing_audit_empty_then_with_the_routers_own_routes(tmp_path: Path) -> None:
    with loaded_router(tmp_path) as client:
        empty = json_of(kvctl(client, "top", "--once", "--interval", "0.01", "-o", "json"))
        for n in range(3):
            assert client.post("/v1/route", json={"token_ids": PROMPT, "request_id": f"req-{n}"}).status_code == 200
        routed = json_of(kvctl(client, "top", "--once", "--interval", "0.01", "-o", "json"))
        table = kvctl(client, "top", "--once", "--interval", "0.01")
    assert (empty["audit"]["decisions"], empty["audit_note"]) == (0, None)
    assert empty["audit"]["looked_at"].startswith("no decision heard in the last 300 s (0 since start)")
    assert (routed["audit"]["decisions"], routed["audit"]["cached_decisions"], routed["audit"]["optimal_share"]) == \
        (3, 3, 1.0)
    assert table.exit_code == 0, table.output
    assert "routing audit" in table.stdout.splitlines()  # a table's title, then its fields
    assert "100% of 3 decisions with cache to find went to a worker holding the most" in table.stdout
    assert table.stderr == ""
