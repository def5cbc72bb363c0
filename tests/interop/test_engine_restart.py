"""A Dynamo 1.6.1 mocker restarted on its ports (its event seqs start again from 0, its cache empty): `kvctl serve`
following its ZMQ stream clears the worker and follows the new stream, holding what a Dynamo indexer that joined
the new engine from its start holds, and `kvctl doctor` names the restart.

A fleet of its own (the test restarts a mocker): two mockers on Dynamo's default ZMQ event plane, the frontend and
kvctl on the mockers' ZMQ streams and replays. The reference indexer is started after the restart, on the restarted
mocker only: Dynamo's indexer following a stream across its engine's restart was seen to keep the old engine's
blocks and to take none of the new engine's (its seqs start below the last one it saw), so it cannot be the
reference here.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.commands.live_router import kvctl
from tests.doctor.rig import doctor, findings
from tests.interop.fleet import (
    JOIN_S,
    KV_BLOCKS,
    Fleet,
    indexer_blocks,
    kvctl_blocks,
    settled,
    shared_prefix_load,
    start_fleet,
    wait_until,
)


@pytest.fixture
def own_fleet(dynamo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    started = start_fleet(tmp_path_factory.mktemp("interop-engine-restart"), dynamo, mockers=2, indexer=False)
    yield started
    started.stop()


def test_kvctl_follows_a_restarted_engine_and_doctor_names_it(own_fleet: Fleet, tmp_path: Path) -> None:
    url = own_fleet.kvctl_url
    assert url is not None
    assert not shared_prefix_load(own_fleet.frontend_url, seed=1).failed
    before = settled(lambda: kvctl_blocks(url), "kvctl's index", procs=own_fleet.procs)
    restarted, other = own_fleet.mockers
    routed = Counter(worker for worker, *_ in own_fleet.frontend.decisions())
    # The frontend's picks tell a load that skipped the worker from events kvctl never got (a mocker whose publisher
    # could not bind its port publishes nothing): seen once in CI, not reproduced.
    assert before.get(restarted.worker_id, 0) > 0, f"kvctl: {before}; frontend's picks: {routed}\n{own_fleet.dump()}"

    own_fleet.restart_mocker(restarted)
    own_fleet.await_mocker(restarted)
    assert restarted.dynamo_id != restarted.worker_id  # a new worker to Dynamo, the same stream to kvctl
    own_fleet.start_indexer([restarted])
    own_fleet.await_indexer()
    wait_until(lambda: own_fleet.frontend.workers(own_fleet) == {restarted.dynamo_id, other.worker_id},
               "the frontend routing to the restarted mocker", timeout=30, procs=own_fleet.procs)
    time.sleep(JOIN_S)  # the indexer's SUB, and kvctl's reconnected one, joined before the new engine publishes

    assert not shared_prefix_load(own_fleet.frontend_url, seed=2).failed
    theirs = settled(lambda: indexer_blocks(own_fleet), "the indexer's dump", procs=own_fleet.procs)
    ours = settled(lambda: kvctl_blocks(url), "kvctl's index", procs=own_fleet.procs)
    assert 0 < ours[restarted.worker_id] <= KV_BLOCKS, ours
    assert theirs == {restarted.worker_id: ours[restarted.worker_id]}

    mine = tmp_path / "kvctl-restarted-worker.json"
    mine.write_text(json.dumps(httpx.get(f"{url}/v1/tree", params={"worker": restarted.worker_id}, timeout=10).json()))
    diff = kvctl(url, "tree", "diff", "--exit-code", str(mine), f"dynamo+{own_fleet.indexer_url}")
    assert diff.exit_code == 0, f"{diff.output}\n{own_fleet.dump()}"

    streams = {s["worker"]["worker_id"]: s for s in httpx.get(f"{url}/v1/status", timeout=10).json()["streams"]}
    assert streams[restarted.worker_id]["restarts"] == 1, streams[restarted.worker_id]
    assert streams[other.worker_id]["restarts"] == 0, streams[other.worker_id]
    assert all(s["lost_batches"] == 0 and not s["decode_errors"] for s in streams.values()), streams

    code, report = doctor(url)
    assert (code, report["status"]) == (1, "WARNING"), report
    (restarts,) = findings(report, "restarts")
    assert restarts["evidence"]["workers"] == [f"{restarted.worker_id}:0"]
    assert restarts["evidence"]["restarts"] == {f"{restarted.worker_id}:0": 1}
