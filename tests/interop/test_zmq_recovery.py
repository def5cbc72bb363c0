"""A `kvctl serve --dynamo-discovery file:DIR|etcd:URL` started after a Dynamo 1.6.1 fleet (ZMQ event plane, no
NATS) has served requests: the plane keeps no history, so kvctl asks each worker for its index over Dynamo's
request plane, as Dynamo's routers do, and then holds the same index as Dynamo's indexer (`tree diff
--exit-code`), before and after more evicting load. A fleet of its own per discovery backend: two mockers, the
frontend, the indexer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.commands.live_router import kvctl
from tests.etcd_server import EtcdServer
from tests.interop.fleet import (
    Fleet,
    Router,
    indexer_blocks,
    kvctl_blocks,
    settled,
    shared_prefix_load,
    start_fleet,
    wait_until,
)


@pytest.fixture(scope="module", params=["file", "etcd"])
def served_fleet(request: pytest.FixtureRequest, dynamo: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[Fleet]:
    """The fleet (its discovery in files, or in a real etcd), after load that made its mockers store (and
    evict) blocks no late router saw published."""
    etcd = EtcdServer(tmp_path_factory.mktemp("interop-etcd")) if request.param == "etcd" else None
    try:
        started = start_fleet(tmp_path_factory.mktemp(f"interop-zmq-recovery-{request.param}"), dynamo, mockers=2,
                              nats_url=None, kvctl=False, etcd_url=None if etcd is None else etcd.url)
        try:
            load = shared_prefix_load(started.frontend_url, seed=11)
            assert load.failed == [] and load.cached_tokens > 0
            yield started
        finally:
            started.stop()
    finally:
        if etcd is not None:
            etcd.stop()


def discovery_of(fleet: Fleet) -> str:
    return f"file:{fleet.discovery_dir}" if fleet.etcd_url is None else f"etcd:{fleet.etcd_url}"


def recovery(url: str) -> dict[int, dict[str, Any]]:
    """Each worker's recovery row in the router's status."""
    workers = httpx.get(f"{url}/v1/status", timeout=10).json()["event_plane"]["workers"]
    return {w["worker_id"]: w.get("recovery") or {} for w in workers}


def same_index(fleet: Fleet, url: str) -> None:
    ours = settled(lambda: kvctl_blocks(url, fleet.model), "the late router's index", procs=fleet.procs)
    theirs = settled(lambda: indexer_blocks(fleet), "the indexer's dump", procs=fleet.procs)
    diff = kvctl(url, "tree", "diff", "--exit-code", "-o", "json", url, f"dynamo+{fleet.indexer_url}")
    assert diff.exit_code == 0, f"{diff.output}\nkvctl: {ours}\nindexer: {theirs}\n{fleet.dump()}"


def test_a_late_router_recovers_every_workers_index_over_the_request_plane(served_fleet: Fleet) -> None:
    fleet = served_fleet
    assert all(indexer_blocks(fleet).get(w) for w in fleet.worker_ids)  # blocks stored before the router exists
    late: Router = fleet.start_router("late", "--dynamo-discovery", discovery_of(fleet), "--namespace", "dynamo")
    fleet.await_router(late)

    def recovered() -> dict[int, dict[str, Any]] | None:
        rows = recovery(late.url)
        return rows if all(rows.get(w, {}).get("state") == "recovered" for w in fleet.worker_ids) else None

    rows = wait_until(recovered, "the late router recovering both workers", timeout=30, procs=fleet.procs)
    assert all(rows[w]["events"] > 0 for w in fleet.worker_ids), rows
    same_index(fleet, late.url)

    assert shared_prefix_load(fleet.frontend_url, requests=24, seed=12).failed == []  # live events, evictions
    same_index(fleet, late.url)
    status = httpx.get(f"{late.url}/v1/status", timeout=10).json()["event_plane"]
    assert status["decode_errors"] == {} and status["counts"].get("recovery_failures", 0) == 0, status["counts"]
    assert status["counts"]["recovered_workers"] == 2 and status["recovery"]["workers"] == {"recovered": 2}
