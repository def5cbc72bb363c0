"""A restart that restores less than its state dir acknowledged says so, and how much (issue 36): `/readyz` 200
"partial", `/v1/status` (`restore.lost`, `health`), `/metrics`, systemd's STATUS= and doctor's `part:state_dir`
finding, never "ready"; an ordinary restart logs nothing louder than INFO (issue 37).

The state dirs are real files written by the router's own code in this process (a state log of 24 chains in 6
segments, one write each, folded twice into images by the compaction child's `fold.main`), then cut, deleted or
damaged as a disk, an operator or a cleanup job would; each restart is a real `kvctl serve`. The full disk is the
router's file size limit (RLIMIT_FSIZE, as in test_disk_full): its writes really fail, then it is killed with -9.
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
from array import array
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvctl.core.events import Stored
from kvctl.server.persistence import fold, records, segments, snapshot
from kvctl.server.persistence.state_log import StateLog
from kvctl.server.state import Fleet
from tests.doctor.rig import doctor, findings
from tests.reliability.test_disk_full import FAILED, chains, count, full, held, post
from tests.reliability.test_engine_faults import router
from tests.server.test_sd_notify import notify_path, receive  # noqa: F401 (notify_path: a fixture)
from tests.server.test_serve_process import _stop, serving
from tests.support.eventually import eventually

CHAIN, PER_SEGMENT, SEGMENTS = 64, 4, 6
BLOCKS = CHAIN * PER_SEGMENT * SEGMENTS  # 1,536
# Positions in the state dir's count of changes: chain 0's write holds the model, its worker and its batch
# (0..2), chains 1-3 a worker and a batch each (3..8), every later chain its batch alone: chain n at n + 5.
FIRST_ALONE = 4


def position(chain: int) -> int:
    assert chain >= FIRST_ALONE
    return chain + 5


def _chain(n: int) -> Stored:
    rng = random.Random(n)
    return Stored(None, [rng.getrandbits(63) for _ in range(CHAIN)], array("Q", (rng.getrandbits(63)
                                                                                  for _ in range(CHAIN))))


@pytest.fixture(scope="module")
def written_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Segments 0-5 of 4 chains each (one write per chain, fsynced), compacted twice: the image holds segments
    0-3, the previous image 0-1, and segments 0-1 are deleted."""
    path = tmp_path_factory.mktemp("state")
    fleet = Fleet(block_size=16)
    state_log = StateLog(path, fleet, restored_from=None)
    for n in range(PER_SEGMENT * SEGMENTS):
        fleet.apply_engine_batch("default", (n % 4, 0), [_chain(n)], 0.0)
        state_log.flush(fsync=True).result()
        if n % PER_SEGMENT == PER_SEGMENT - 1:
            state_log.rotate()[1].result()
    state_log.close()
    assert fold.main([str(path), "--upto", "2", "--block-size", "16"]) == 0
    assert fold.main([str(path), "--upto", "4", "--block-size", "16"]) == 0
    assert segments.numbers(path) == [2, 3, 4, 5, 6]
    return path


@pytest.fixture
def state(written_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(written_dir, tmp_path / "state"))


def blocks(client: httpx.Client) -> int:
    return int(client.get("/v1/tree/stats").json()["models"]["default"]["blocks"])


def partial(client: httpx.Client) -> dict[str, Any]:
    """The loss as all four places say it, checked to agree: `/v1/status` `restore.lost`."""
    ready = client.get("/readyz")
    assert (ready.status_code, ready.json()["status"]) == (200, "partial"), ready.text
    status = client.get("/v1/status").json()
    lost = status["restore"]["lost"]
    assert ready.json()["faults"] == [f"state_dir: {lost['reason']}"]
    [fault] = status["health"]["faults"]
    assert (fault["part"], fault["reason"], fault["blocks_ready"]) == ("state_dir", lost["reason"], False)
    assert {(loss["surface"], loss["cause"]): loss["count"] for loss in status["health"]["losses"]} == {
        ("state_dir", cause): n for cause, n in lost["by_cause"].items()}
    metrics = client.get("/metrics").text
    assert 'kvctl_part_down{blocks_ready="false",part="state_dir"} 1.0' in metrics
    for cause, n in lost["by_cause"].items():
        assert f'kvctl_input_lost_total{{cause="{cause}",surface="state_dir"}} {float(n)}' in metrics
    _, report = doctor(str(client.base_url).rstrip("/"))
    [finding] = findings(report, "part:state_dir")
    assert finding["severity"] == "WARNING" and lost["reason"] in finding["cause"], finding
    assert "kvctl router reset" in finding["next_step"]
    assert blocks(client) == lost["blocks"]
    return dict(lost)


def test_an_intact_compacted_state_dir_restarts_whole_and_quiet(state: Path) -> None:
    with serving(state) as (proc, client):
        assert client.get("/readyz").json()["status"] == "ready"
        assert client.get("/v1/status").json()["restore"]["lost"] is None
        assert blocks(client) == BLOCKS
        log = _stop(proc)
    assert " WARNING " not in log and " ERROR " not in log, log


def test_a_segment_cut_mid_file_restarts_partial_naming_it(state: Path) -> None:
    segment = segments.path(state, 4)  # chains 16-19, after the image
    offsets = [at for at, _ in records.read(segment, [])]
    data = segment.read_bytes()
    segment.write_bytes(data[:(offsets[2] + offsets[3]) // 2])  # mid-way through chain 18's write
    with serving(state) as (proc, client):
        lost = partial(client)
        _stop(proc)
    assert lost["reason"] == (f"restored {BLOCKS - 2 * CHAIN:,} of {BLOCKS:,} blocks: 2 acknowledged state log "
                              f"records missing: state.log.00000004 cut short at byte {offsets[2]:,} "
                              f"(records {position(18)} to {position(19)})")
    assert (lost["records"], lost["by_cause"]) == (2, {"cut_short": 2})


def test_a_segment_deleted_after_the_image_restarts_partial_until_the_index_is_reset(
        state: Path, notify_path: tuple[socket.socket, str],  # noqa: F811 (the fixture imported)
        monkeypatch: pytest.MonkeyPatch) -> None:
    segments.path(state, 4).unlink()
    notify, value = notify_path
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    with serving(state) as (proc, client):
        lost = partial(client)
        assert lost["reason"] == (f"restored {BLOCKS - 4 * CHAIN:,} of {BLOCKS:,} blocks: 4 acknowledged state "
                                  f"log records missing: state.log.00000004 missing "
                                  f"(records {position(16)} to {position(19)})")
        assert lost["gaps"] == [{"first": position(16), "end": position(20), "where": "state.log.00000004 missing",
                                 "cause": "segment_missing"}]
        told = receive(notify)
        while "READY" not in told:
            told = receive(notify)
        assert told["STATUS"].startswith(f"serving {client.base_url}, PARTIAL index, {lost['reason']}"), told

        assert client.post("/v1/reset", json={}).status_code == 200  # the operator starts the index over
        assert client.get("/readyz").json()["status"] == "ready"
        log = _stop(proc)
    assert f"ERROR kvctl.serve: state_dir: {lost['reason']}" in log
    assert "state_dir: working again" in log


def test_both_images_damaged_after_compactions_restart_partial_then_the_next_start_is_whole(state: Path) -> None:
    for name in (snapshot.FILENAME, snapshot.PREVIOUS):
        image = state / name
        data = bytearray(image.read_bytes())
        data[len(data) // 2] ^= 0xFF
        image.write_bytes(bytes(data))
    with serving(state) as (proc, client):
        lost = partial(client)
        # The state dir starts from what the router holds, at once: the next restart reports only new losses.
        eventually(lambda: client.get("/v1/status").json()["restore"]["log"]["images_after_loss"],
                   "an image of the index as restored")
        _stop(proc)
    restored = BLOCKS - 8 * CHAIN  # chains 0-7 were in segments 0-1, folded into the images, then deleted
    assert lost["reason"] == (f"restored {restored:,} of {BLOCKS:,} blocks: {position(8)} acknowledged state log "
                              f"records missing: before state.log.00000002, in the images that were damaged "
                              f"(records 0 to {position(8) - 1})")
    assert lost["by_cause"] == {"image_damaged": position(8)}
    with serving(state) as (proc, client):
        assert client.get("/readyz").json()["status"] == "ready"
        assert blocks(client) == restored
        _stop(proc)


def test_a_full_disk_then_kill_9_restarts_partial_saying_what_was_never_written(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with router(state, "--snapshot-interval", "0.2") as (proc, client, log):
        first = full(client, state, proc.pid, log, 0)  # what it holds is written and fsynced; then no room
        before = held(client)
        post(client, chains(first, 3 * first))  # taken, acknowledged to the sender, never written
        eventually(lambda: count(log, FAILED), "the write failing")
        eventually(lambda: count(log, "image after lost writes"), "an image after it failing too")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    with router(state) as (proc, client, log):
        lost = partial(client)
        assert held(client) == before
    assert lost["reason"].startswith(f"restored {len(before):,} of {4 * len(before):,} blocks: "
                                     f"{3 * first} acknowledged state log records missing: writes to "
                                     "state.log.00000000 after byte "), lost
    assert "that failed (a full disk?), and no image of the index since" in lost["reason"]
    assert lost["by_cause"] == {"write_failed": 3 * first}

