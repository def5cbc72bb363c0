"""`kvctl serve --dynamo-discovery file:DIR` following a Dynamo 1.6.1 fleet on Dynamo's default event plane (ZMQ,
file discovery, no NATS anywhere): the same index as Dynamo's indexer on the mockers' vLLM ZMQ streams, through
load that makes them evict, and every topic decoded with no error. A fleet of its own (module-scoped): two
mockers, the frontend with replica sync, the indexer, and this router, started with the fleet."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.commands.live_router import kvctl
from tests.doctor.rig import doctor, findings
from tests.interop.fleet import (
    KV_BLOCKS,
    Fleet,
    indexer_blocks,
    kvctl_blocks,
    replica_sync_both_ways,
    settled,
    shared_prefix_load,
    start_fleet,
    wait_until,
)

ROUTER = "zmq"
SHARING = ("--replica-sync", "--advertise-host", "127.0.0.1")  # what a Dynamo router with replica sync does
TOPICS = ("kv-events", "kv_metrics", "active_sequences_events", "forward-pass-metrics")


def plane(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/v1/status", timeout=10).json()["event_plane"]


def following(fleet: Fleet) -> bool:
    """Every mocker's kv-events channel connected (the publishers found, their sockets joined)."""
    status = plane(fleet.routers[ROUTER].url)
    kv = [c for c in status["connections"] if c["topic"] == "kv-events" and c["connected"]]
    return status["ready"] and len(kv) == len(fleet.mockers)


@pytest.fixture(scope="module")
def zmq_fleet(dynamo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    workdir = tmp_path_factory.mktemp("interop-zmq-fleet")
    discovery = workdir / "discovery"  # the fleet's DYN_FILE_KV (Fleet.discovery_dir), made by its first mocker
    started = start_fleet(workdir, dynamo, mockers=2, nats_url=None, kvctl=False,
                          routers={ROUTER: ["--dynamo-discovery", f"file:{discovery}", "--namespace", "dynamo",
                                            *SHARING]})
    assert started.discovery_dir == discovery
    try:  # before any request: the ZMQ plane keeps no history
        wait_until(lambda: following(started) or None, "kvctl following every mocker's kv-events channel",
                   timeout=30, procs=started.procs)
    except BaseException:
        started.stop()
        raise
    yield started
    started.stop()


def test_the_zmq_router_holds_dynamos_index_and_decodes_every_topic(zmq_fleet: Fleet) -> None:
    holds_dynamos_index_and_decodes_every_topic(zmq_fleet, seed=3)


def holds_dynamos_index_and_decodes_every_topic(fleet: Fleet, seed: int) -> None:
    """Evicting load through the frontend; then kvctl's index is the indexer's, every topic decoded, none lost."""
    url = fleet.routers[ROUTER].url
    load = shared_prefix_load(fleet.frontend_url, seed=seed)
    assert load.failed == [] and load.cached_tokens > 0

    ours = settled(lambda: kvctl_blocks(url, fleet.model), "the ZMQ router's index", procs=fleet.procs)
    theirs = settled(lambda: indexer_blocks(fleet), "the indexer's dump", procs=fleet.procs)
    diff = kvctl(url, "tree", "diff", "--exit-code", "-o", "json", url, f"dynamo+{fleet.indexer_url}")
    assert diff.exit_code == 0, f"{diff.output}\nkvctl: {ours}\nindexer: {theirs}\n{fleet.dump()}"
    report = json.loads(diff.stdout)
    assert {w["worker_id"] for w in report["workers"]} == set(fleet.worker_ids)
    assert all(0 < blocks <= KV_BLOCKS for blocks in ours.values()), ours  # evictions arrived over ZMQ too

    status = plane(url)
    assert status["transport"] == "zmq" and status["decode_errors"] == {}, status
    assert all(status["topics"][topic] > 0 for topic in TOPICS), status["topics"]
    assert status["sequence"]["lost"] == 0 and status["counts"].get("lost_events", 0) == 0, status
    assert status["counts"]["load_reports"] > 0 and status["counts"]["forward_passes"] > 0
    assert status["counts"].get("peer_sequence_events", 0) > 0  # the frontend's replica-sync batches
    assert status["discovery"]["record_errors"] == {}
    rows = {w["worker_id"]: w for w in httpx.get(f"{url}/v1/workers", timeout=10).json()["workers"]}
    assert set(rows) == set(fleet.worker_ids)
    for row in rows.values():  # what each worker says of itself: its KV usage and its forward passes
        assert row["reported"]["kv_used_blocks"] is not None and row["forward_pass"]["counter_id"] > 0, row


def test_the_cli_views_read_the_zmq_plane_as_they_read_nats(zmq_fleet: Fleet) -> None:
    url = zmq_fleet.routers[ROUTER].url
    shown = kvctl(url, "router", "status", "-o", "wide")
    assert shown.exit_code == 0 and "zmq" in shown.stdout and "sockets connected" in shown.stdout, shown.output
    assert "event plane publishers" in shown.stdout  # each publisher: its scope, sequence, gaps and address
    heard = plane(url)["publishers"]
    assert heard and all(p["address"] in shown.stdout and str(p["publisher_id"]) in shown.stdout for p in heard), \
        shown.stdout
    assert shared_prefix_load(zmq_fleet.frontend_url, requests=4, seed=9).failed == []  # events from each worker

    def workers_json() -> Any:
        return kvctl(url, "workers", "-o", "json")

    workers = wait_until(lambda: (w := workers_json()).exit_code == 0 and all(
        (r["event_plane"] or {}).get("address") for r in json.loads(w.stdout)["workers"]) and w or None,
        "each worker's publisher known", timeout=15, procs=zmq_fleet.procs)
    rows = json.loads(workers.stdout)["workers"]
    assert workers.exit_code == 0 and {w["worker_id"] for w in rows} == set(zmq_fleet.worker_ids), workers.output
    for row in rows:  # where its events come from: the publisher's advertised address; its index recovered
        source = row["event_plane"]
        assert source["address"].startswith("tcp://127.0.0.1:") and source["recovery"]["state"] == "recovered", row
    top = kvctl(url, "top", "--once")  # the plane's publishers, their losses and sockets in one line
    sockets = sum(1 for c in plane(url)["connections"] if c["connected"])
    assert top.exit_code == 0 and f"{len(plane(url)['publishers'])} publishers · gaps 0 · lost 0" in top.stdout, \
        top.output
    assert f"sockets {sockets}/{len(plane(url)['connections'])}" in top.stdout, top.output
    wide = kvctl(url, "workers", "-o", "wide")
    assert all(w["event_plane"]["address"] in wide.stdout for w in rows) and "recovered" in wide.stdout, wide.output
    _, report = doctor(url)
    (plane_check,) = findings(report, "event_plane")
    assert plane_check["severity"] == "OK" and "none lost" in plane_check["cause"], plane_check


def test_replica_sync_both_ways_over_the_zmq_plane(zmq_fleet: Fleet) -> None:
    replica_sync_both_ways_over_zmq(zmq_fleet)


def replica_sync_both_ways_over_zmq(fleet: Fleet) -> None:
    """The frontend's requests on kvctl, and kvctl's on the frontend, through each one's own channel record."""
    url = fleet.routers[ROUTER].url
    replica_sync_both_ways(fleet, url, plane, fleet.model)
    (shared,) = plane(url)["sharing"]["channels"]
    assert shared["sent"] >= 2 and shared["address"].startswith("tcp://127.0.0.1:"), shared
    assert shared["channel"].startswith("v1/event_channels/namespace/dynamo/component/backend/endpoint/generate/"
                                        "topic/active_sequences_events/")


def test_events_tail_follows_the_zmq_plane_through_discovery(zmq_fleet: Fleet) -> None:
    """`kvctl events tail --dynamo-discovery`: no router, the publishers found in the store as a router finds
    them, each KV event decoded."""
    tail = subprocess.Popen([sys.executable, "-m", "kvctl", "events", "tail", "--dynamo-discovery",
                             f"file:{zmq_fleet.discovery_dir}", "--namespace", "dynamo", "--count", "5",
                             "--duration", "30", "-o", "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert tail.stderr is not None
        listening = tail.stderr.readline()
        assert listening.startswith("listening on") and "(2 publishers)" in listening, listening
        assert shared_prefix_load(zmq_fleet.frontend_url, requests=6, seed=8).failed == []
        out, err = tail.communicate(timeout=40)
    finally:
        tail.kill()
    assert tail.returncode == 0, err
    events = [json.loads(line)["event"] for line in out.splitlines()]
    assert len(events) == 5 and {e["worker_id"] for e in events} <= set(zmq_fleet.worker_ids), events
    assert all("stored" in e["event"]["data"] or "removed" in e["event"]["data"] for e in events)
    assert "decode errors none" in err


def test_a_restarted_mocker_is_followed_under_its_new_identity(zmq_fleet: Fleet) -> None:
    """Runs after the tests above (same fleet): a restart is a new identity, new publishers, ports and keys."""
    restarted_mocker_is_followed(zmq_fleet)


def restarted_mocker_is_followed(fleet: Fleet) -> None:
    """The old identity's sockets and blocks dropped with its records, the new one followed, nothing lost."""
    url = fleet.routers[ROUTER].url
    restarted, other = fleet.mockers
    old_id = restarted.dynamo_id
    old = {p["publisher_id"] for p in plane(url)["publishers"] if f"{old_id}:0" in p["workers"]}
    assert len(old) >= 3, plane(url)["publishers"]  # its KV events, load reports and forward passes
    assert old_id in kvctl_blocks(url, fleet.model)

    fleet.restart_mocker(restarted)
    fleet.await_mocker(restarted)
    new_id = restarted.dynamo_id
    assert new_id != old_id

    def connections() -> list[dict[str, Any]]:
        return plane(url)["connections"]

    wait_until(lambda: not {c["publisher_id"] for c in connections()} & old or None,
               "the old identity's sockets dropped with its records", timeout=30, procs=fleet.procs)
    wait_until(lambda: len([c for c in connections() if c["topic"] == "kv-events" and c["connected"]]) == 2 or None,
               "the new identity's kv-events channel followed", timeout=30, procs=fleet.procs)
    workers = {w["worker_id"] for w in httpx.get(f"{url}/v1/workers", timeout=10).json()["workers"]}
    assert old_id not in workers and old_id not in kvctl_blocks(url, fleet.model), workers  # its blocks went with it
    wait_until(lambda: fleet.frontend.workers(fleet) == {new_id, other.worker_id} or None,
               "the frontend routing to the restarted mocker", timeout=30, procs=fleet.procs)

    assert shared_prefix_load(fleet.frontend_url, requests=24, seed=6).failed == []
    ours = settled(lambda: kvctl_blocks(url, fleet.model), "the ZMQ router's index", procs=fleet.procs)
    assert set(ours) == {new_id, other.worker_id} and 0 < ours[new_id] <= KV_BLOCKS, ours
    status = plane(url)
    assert status["decode_errors"] == {} and status["counts"]["workers_removed"] == 1, status
    assert status["sequence"]["lost"] == 0 and status["counts"].get("lost_events", 0) == 0, status
