"""`kvctl serve --nats` following a Dynamo 1.6.1 fleet's NATS event plane (`--event-plane nats`): the same index as
Dynamo's indexer on the mockers' ZMQ streams, every topic decoded, and replica sync with Dynamo's frontend
(`--router-replica-sync`) seen on both sides."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import httpx

from tests.commands.live_router import kvctl
from tests.interop.conftest import NATS_ROUTER
from tests.interop.fleet import (
    KV_BLOCKS,
    Fleet,
    indexer_blocks,
    kvctl_blocks,
    replica_sync_both_ways,
    settled,
    shared_prefix_load,
)

TOPICS = ("kv-events", "kv_metrics", "active_sequences_events", "forward-pass-metrics")


def plane(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/v1/status", timeout=10).json()["event_plane"]


def test_the_nats_router_holds_dynamos_index_and_decodes_every_topic(fleet: Fleet) -> None:
    url = fleet.routers[NATS_ROUTER].url
    load = shared_prefix_load(fleet.frontend_url, seed=3)
    assert load.failed == [] and load.cached_tokens > 0

    ours = settled(lambda: kvctl_blocks(url), "the NATS router's index", procs=fleet.procs)
    theirs = settled(lambda: indexer_blocks(fleet), "the indexer's dump", procs=fleet.procs)
    diff = kvctl(url, "tree", "diff", "--exit-code", "-o", "json", url, f"dynamo+{fleet.indexer_url}")
    assert diff.exit_code == 0, f"{diff.output}\nkvctl: {ours}\nindexer: {theirs}\n{fleet.dump()}"
    report = json.loads(diff.stdout)
    assert {w["worker_id"] for w in report["workers"]} == set(fleet.worker_ids)
    assert all(0 < blocks <= KV_BLOCKS for blocks in ours.values()), ours  # evictions arrived over NATS too

    status = plane(url)
    assert status["decode_errors"] == {}, status
    assert all(status["topics"][topic] > 0 for topic in TOPICS), status["topics"]
    assert status["sequence"]["lost"] == 0 and status["counts"].get("lost_events", 0) == 0, status
    assert status["counts"]["load_reports"] > 0 and status["counts"]["forward_passes"] > 0
    rows = {w["worker_id"]: w for w in httpx.get(f"{url}/v1/workers", timeout=10).json()["workers"]}
    assert set(rows) == set(fleet.worker_ids)
    for row in rows.values():  # what each worker says of itself: its KV usage and its forward passes
        assert row["reported"]["kv_used_blocks"] is not None and row["forward_pass"]["counter_id"] > 0, row


def test_replica_sync_both_ways_with_dynamos_frontend(fleet: Fleet) -> None:
    replica_sync_both_ways(fleet, fleet.routers[NATS_ROUTER].url, plane, "default")


def test_events_tail_decodes_the_fleets_nats_plane(fleet: Fleet) -> None:
    assert fleet.nats_url is not None
    tail = subprocess.Popen([sys.executable, "-m", "kvctl", "events", "tail", "--nats", fleet.nats_url,
                             "--namespace", "dynamo", "--count", "5", "--duration", "30", "-o", "json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert tail.stderr is not None and tail.stderr.readline().startswith("listening on")
        assert shared_prefix_load(fleet.frontend_url, requests=6, seed=5).failed == []
        out, err = tail.communicate(timeout=40)
    finally:
        tail.kill()
    assert tail.returncode == 0, err
    events = [json.loads(line)["event"] for line in out.splitlines()]
    assert len(events) == 5 and {e["worker_id"] for e in events} <= set(fleet.worker_ids)
    assert all("stored" in e["event"]["data"] or "removed" in e["event"]["data"] for e in events)
    assert "decode errors none" in err
