"""`kvctl doctor` against a kvctl router following a Dynamo 1.6.1 fleet's ZMQ streams: OK while the fleet is
healthy, and a stopped mocker named (it goes silent while the others keep serving).

The test stops a mocker, so it has a fleet of its own: two mockers on Dynamo's default ZMQ event plane (no NATS),
Dynamo's frontend, and `kvctl serve` on the mockers' vLLM ZMQ streams. One test, two phases: the healthy
verdict first is what shows the later one comes from the stop.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.doctor.rig import doctor, findings
from tests.interop.fleet import Fleet, shared_prefix_load, start_fleet, wait_until

CHECKS = {"workers", "silent", "streams", "block_size", "hashing", "busy", "index"}
SILENT_AFTER_S = 3


@pytest.fixture
def own_fleet(dynamo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    started = start_fleet(tmp_path_factory.mktemp("interop-doctor"), dynamo, mockers=2, indexer=False)
    yield started
    started.stop()


def _workers_heard(fleet: Fleet) -> set[int]:
    rows = httpx.get(f"{fleet.kvctl_url}/v1/workers", timeout=10).json()["workers"]
    return {w["worker_id"] for w in rows if w["last_event_age_s"] is not None}


def test_doctor_says_ok_on_a_healthy_fleet_then_names_a_stopped_mocker(own_fleet: Fleet) -> None:
    assert own_fleet.kvctl_url is not None
    load = shared_prefix_load(own_fleet.frontend_url, requests=48)
    assert load.failed == []
    wait_until(lambda: _workers_heard(own_fleet) == set(own_fleet.worker_ids),
               "kvctl hearing events from every mocker", timeout=15, procs=own_fleet.procs)

    code, report = doctor(own_fleet.kvctl_url)
    assert (code, report["status"]) == (0, "OK"), report
    assert {f["check"] for f in report["findings"]} >= CHECKS
    assert {f["severity"] for f in report["findings"]} == {"OK"}
    assert findings(report, "workers")[0]["cause"] == "2 workers registered"

    stopped, *live = own_fleet.mockers
    assert stopped.proc.stop() is not None  # SIGTERM, by its pid
    wait_until(lambda: own_fleet.frontend.workers(own_fleet) == {m.worker_id for m in live},
               f"the frontend dropping stopped worker {stopped.worker_id}", timeout=30, procs=[own_fleet.frontend.proc])

    # The live mocker keeps serving (fresh prefixes each round: with several live ones, each gets some) while the
    # stopped one stays silent; doctor must name it, and only it.
    done = threading.Event()
    failures: list[str] = []

    def serve() -> None:
        seed = 100
        while not done.is_set():
            failures.extend(shared_prefix_load(own_fleet.frontend_url, requests=8, concurrency=2, seed=seed).failed)
            seed += 1

    def named() -> dict[str, Any] | None:
        code, report = doctor(own_fleet.kvctl_url, "--silent-after", str(SILENT_AFTER_S))  # type: ignore[arg-type]
        silent = findings(report, "silent")
        return report if code == 1 and silent and silent[0]["evidence"]["workers"] == [f"{stopped.worker_id}:0"] \
            else None

    loader = threading.Thread(target=serve, daemon=True)
    loader.start()
    try:
        report = wait_until(named, f"doctor naming stopped worker {stopped.worker_id} silent, and no other",
                            timeout=40, procs=[m.proc for m in live], interval=0.5)
    finally:
        done.set()
        loader.join(60)
    assert failures == []
    assert report["status"] == "WARNING"
    (silent,) = findings(report, "silent")
    assert silent["severity"] == "WARNING"
    assert silent["cause"].startswith("1 of 2 workers silent")
    assert str(stopped.worker_id) in silent["next_step"]
    assert {f["severity"] for f in report["findings"] if f["check"] != "silent"} == {"OK"}
