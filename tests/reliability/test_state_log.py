"""The state log (issue 27): a router killed with SIGKILL at random points, while it ingests or while a child
compacts its log, restarts with what it had written; the disk written follows what changed, not the index size;
and compaction runs in another process, so routes are answered meanwhile."""

from __future__ import annotations

import contextlib
import json
import random
import re
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kvctl.core.names import parse_worker
from kvctl.server.persistence import segments, snapshot
from tests.reliability.test_snapshot_kill import blocks, chains
from tests.server.test_sd_notify import children_of
from tests.server.test_serve_process import _stop, serving
from tests.support.eventually import eventually
from tests.support.holding import holding

NDJSON = {"content-type": "application/x-ndjson"}
CHAIN = 64  # blocks per chain (`chains`)
OFTEN = ("--snapshot-interval", "0.02", "--compact-log-bytes", "0")  # fsync and compact all the time


def pairs(client: httpx.Client) -> set[tuple[int, int, int]]:
    """(worker, dp_rank, block hash) of every block in the router's dump: equal sets, equal indexes."""
    held = set()
    for row in client.get("/v1/tree").json():
        stored = row["event"]["data"]["stored"]
        held.update((row["worker_id"], row.get("dp_rank", 0), b["block_hash"]) for b in stored["blocks"])
    return held


def written(client: httpx.Client) -> None:
    """Wait until what the router applied so far is on disk: two fsyncs of the log after now."""
    def fsyncs() -> int:
        return int(client.get("/v1/status").json()["restore"]["log"]["fsyncs"])
    before = fsyncs()
    eventually(fsyncs, "two state log fsyncs", until=lambda n: n >= before + 2)


def test_sigkill_at_random_points_restores_what_was_written(tmp_path: Path) -> None:
    rng = random.Random(27)
    expected: set[tuple[int, int, int]] = set()
    for round_ in range(6):
        with serving(tmp_path, *OFTEN) as (proc, client):
            assert pairs(client) == expected, f"round {round_}: the restart lost or invented blocks"
            assert client.get("/readyz").json()["status"] == "ready", "a kill -9 loses nothing acknowledged"
            answer = client.post("/v1/events", content=chains(40, start=40 * round_), headers=NDJSON)
            assert answer.json()["rejected"] == {}
            if round_ % 2:
                client.delete("/v1/workers/1")  # removals are logged too
            written(client)
            expected = pairs(client)
            time.sleep(rng.uniform(0.0, 0.3))  # compactions run back to back: kills land in them too
            proc.kill()
            proc.wait()
    assert list(tmp_path.glob("*.damaged")) == []
    with serving(tmp_path) as (proc, client):
        assert pairs(client) == expected


def test_sigkill_mid_ingest_restores_a_prefix_of_each_workers_batches(tmp_path: Path) -> None:
    """Each POST is one chain of one worker, so any state the log can give back holds whole chains, and for
    each worker the first k of those it was sent: never a later one without an earlier, never half of one."""
    rng = random.Random(2727)
    for kill in range(3):
        least = 20 + 20 * kill
        _kill_mid_ingest(tmp_path, lambda proc, sent, least=least: (
            eventually(sent.__len__, "some chains applied", until=lambda n: n >= least),
            time.sleep(rng.uniform(0.0, 1.0))))


def test_sigkill_during_compaction_restores_a_prefix_of_each_workers_batches(tmp_path: Path) -> None:
    for _ in range(2):  # killed the moment a compaction child is seen, mid-ingest
        _kill_mid_ingest(tmp_path, lambda proc, sent: eventually(
            lambda: _compacting(proc.pid) if len(sent) > 20 else [], "a compaction child mid-ingest",
            interval=0.002))


def _kill_mid_ingest(state_dir: Path, until_kill: Callable[[subprocess.Popen[str], list[int]], object]) -> None:
    """Post chains one by one, SIGKILL the router once `until_kill` returns, restart, check each worker's
    blocks are the first k chains it was sent, for some k."""
    sent: list[int] = []
    with serving(state_dir, "--reset-states", *OFTEN) as (proc, client):
        poster = threading.Thread(target=_post_one_by_one, args=(client, sent))
        poster.start()
        until_kill(proc, sent)
        proc.kill()
        poster.join()
    with serving(state_dir) as (proc, client):
        assert client.get("/readyz").json()["status"] == "ready", "a kill -9 loses nothing acknowledged"
        workers = client.get("/v1/tree/stats").json()["models"]["default"]["workers"]
        held = pairs(client)
    chains_of = {w: {n for n in range(400) if n % 4 == w} for w in range(4)}
    for w, count in ((parse_worker(k)[0], v) for k, v in workers.items()):
        assert count % CHAIN == 0, f"worker {w} holds {count} blocks: part of a batch"
        k = count // CHAIN
        first_k = sorted(chains_of[w])[:k]
        want = {b for (wid, _, b) in pairs_of(first_k) if wid == w}
        assert {b for (wid, _, b) in held if wid == w} == want, f"worker {w}: not its first {k} chains"
    assert sum(workers.values()) <= len(sent) * CHAIN + 4 * CHAIN  # posts in flight when killed


def _post_one_by_one(client: httpx.Client, sent: list[int]) -> None:
    """Chain n to worker n % 4, one POST each, until the router is gone; `sent` gets each one answered."""
    for n in range(400):
        try:
            client.post("/v1/events", content=chains(1, start=n), headers=NDJSON)
        except httpx.HTTPError:
            return
        sent.append(n)


def pairs_of(numbers: list[int]) -> set[tuple[int, int, int]]:
    """The pairs `chains` stores for these chain numbers, computed without a router."""
    out = set()
    for n in numbers:
        row = json.loads(chains(1, start=n))
        out.update((row["worker_id"], 0, b["block_hash"]) for b in row["event"]["data"]["stored"]["blocks"])
    return out


def test_sigterm_writes_no_image_and_the_restart_restores_everything(tmp_path: Path) -> None:
    with serving(tmp_path) as (proc, client):
        assert client.post("/v1/events", content=chains(200), headers=NDJSON).json()["rejected"] == {}
        expected = pairs(client)
        _stop(proc)
    assert not (tmp_path / snapshot.FILENAME).exists(), "SIGTERM wrote a full image"
    with serving(tmp_path) as (proc, client):
        assert pairs(client) == expected
        assert client.get("/readyz").json()["status"] == "ready"


def test_disk_written_follows_the_changes_not_the_index(tmp_path: Path) -> None:
    # The load is logged by a router that does not compact; the next one, compacting at every chance, folds all of
    # it into one image with nothing else arriving. (Loaded and compacted by one router, a compaction could begin
    # mid-load on a busy machine: the image then held part of the load, the rest followed it, and the log after
    # the image never came back to 0.)
    with serving(tmp_path, "--snapshot-interval", "0.02", "--compact-log-bytes", str(1 << 40)) as (proc, client):
        client.post("/v1/events", content=chains(400), headers=NDJSON)
        held = blocks(client)
        written(client)
        _stop(proc)
    with serving(tmp_path, *OFTEN) as (proc, client):
        eventually(lambda: client.get("/v1/status").json()["restore"]["log"], "a compaction of the whole load",
                   until=lambda log: log["compactions"] >= 1 and log["since_image"] == 0)
        _stop(proc)
    image = (tmp_path / snapshot.FILENAME).stat()
    before = {n: segments.path(tmp_path, n).stat().st_size for n in segments.numbers(tmp_path)}
    with serving(tmp_path, "--snapshot-interval", "0.05") as (proc, client):
        assert blocks(client) == held
        for n in range(5):  # a few changes on a large index, over many intervals
            client.post("/v1/events", content=chains(1, start=10_000 + n), headers=NDJSON)
            written(client)
        _stop(proc)
    assert (tmp_path / snapshot.FILENAME).stat().st_mtime_ns == image.st_mtime_ns, "a full image was written"
    after = {n: segments.path(tmp_path, n).stat().st_size for n in segments.numbers(tmp_path)}
    grown = sum(size - before.get(n, 0) for n, size in after.items())
    assert 0 < grown < image.st_size / 20, f"{grown} bytes written for 5 chains beside a {image.st_size} B image"


def test_compaction_runs_in_another_process_while_routes_are_answered(tmp_path: Path) -> None:
    with serving(tmp_path, *OFTEN) as (proc, client):
        client.post("/v1/events", content=chains(1), headers=NDJSON).raise_for_status()  # a worker to route to
        statuses: list[int] = []
        done = threading.Event()

        def route() -> None:  # back to back from before the load until its fold is done, however soon it falls
            with httpx.Client(base_url=client.base_url, timeout=30) as own:
                while not done.is_set():
                    answer = own.post("/v1/route", json={"local_hashes": [1, 2, 3], "reserve": False})
                    statuses.append(answer.status_code)

        router = threading.Thread(target=route)
        router.start()
        try:
            client.post("/v1/events", content=chains(400, start=1), headers=NDJSON).raise_for_status()
            deadline = time.monotonic() + 60
            while client.get("/v1/status").json()["restore"]["log"]["compactions"] < 1:
                assert time.monotonic() < deadline, "no compaction within 60 s of a 400-chain load"
                time.sleep(0.02)
        finally:
            done.set()
            router.join(30)
        log = _stop(proc)
    pids = {int(p) for p in re.findall(r"state log compacted in [\d.]+ s \(pid (\d+)\)", log)}
    assert pids and proc.pid not in pids, f"compaction ran in the router itself: {pids}"
    assert statuses and set(statuses) == {200}, f"routes answered {sorted(set(statuses))}"


def _logged_chains(state_dir: Path, count: int) -> tuple[int, Path]:
    """A router's log holding `count` chains, one POST and one write (frame) each; (blocks held, the segment)."""
    with serving(state_dir, "--snapshot-interval", "0.02") as (proc, client):
        for n in range(count):
            client.post("/v1/events", content=chains(1, start=n), headers=NDJSON)
            written(client)
        held = blocks(client)
        _stop(proc)
    [number] = segments.numbers(state_dir)
    return held, segments.path(state_dir, number)


def test_a_torn_last_record_is_dropped_and_cut_off(tmp_path: Path) -> None:
    held, segment = _logged_chains(tmp_path, 10)
    whole = segment.stat().st_size
    with segment.open("ab") as f:
        f.write(b"\x00\x00\x10\x00\xde\xad")  # a frame head cut short by a kill
    with serving(tmp_path) as (proc, client):
        assert blocks(client) == held
    assert segment.stat().st_size == whole
    assert list(tmp_path.glob("*.damaged")) == []


def test_a_damaged_record_stops_the_replay_before_it_and_is_set_aside(tmp_path: Path) -> None:
    held, segment = _logged_chains(tmp_path, 10)
    data = bytearray(segment.read_bytes())
    data[len(data) // 2] ^= 0xFF  # rot in the middle: records after it are whole
    segment.write_bytes(bytes(data))
    with serving(tmp_path) as (proc, client):
        got = blocks(client)
        restore = client.get("/v1/status").json()["restore"]
        assert 0 < got < held and got % CHAIN == 0, f"{got} of {held} blocks: not the records before the damage"
        assert "checksum mismatch" in restore["log_stopped"]
        client.post("/v1/events", content=chains(1, start=100), headers=NDJSON)
        _stop(proc)
    assert (segment.with_name(segment.name + ".damaged")).read_bytes() == bytes(data)
    with serving(tmp_path) as (proc, client):  # the damage is out of the way: what was restored, and since
        assert blocks(client) == got + CHAIN


def test_a_start_without_restore_never_folds_the_earlier_runs_log_in(tmp_path: Path) -> None:
    _logged_chains(tmp_path, 10)
    with serving(tmp_path, "--no-restore", *OFTEN) as (proc, client):
        client.post("/v1/events", content=chains(1, start=500), headers=NDJSON)
        compactions = client.get("/v1/status").json()["restore"]["log"]["compactions"]
        eventually(lambda: client.get("/v1/status").json()["restore"]["log"]["compactions"],
                   "a compaction", until=lambda n: n >= compactions + 1)
        _stop(proc)
    with serving(tmp_path) as (proc, client):
        assert blocks(client) == CHAIN, "the run before --no-restore came back"


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def _compacting(pid: int) -> list[int]:
    """The router's compaction children now."""
    found = []
    for child in children_of(pid):
        with contextlib.suppress(OSError):
            if b"persistence.fold" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
    return found


def test_sigkill_during_compaction_restores_everything(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The router killed while a compaction of its events is under way: the child dies with it (before it deletes
    a segment the next restore needs), and the restart restores every pair. The child is held mid-way, so the kill
    lands during it however fast or loaded the machine."""
    gate = holding(monkeypatch, "FOLD", tmp_path_factory.mktemp("gates") / "fold")
    gate.touch()  # the first compactions (of the start's own records) run
    with serving(tmp_path, "--snapshot-interval", "0.01", "--compact-log-bytes", "0") as (proc, client):
        # The bounds below are on a child process starting or dying (seconds on a loaded machine), never on order:
        # the hold is what puts the kill inside the compaction.
        eventually(lambda: client.get("/v1/status").json()["restore"]["log"]["compactions"] and not
                   _compacting(proc.pid), "the first compaction (of the start's own records) done", timeout=120)
        # From here on a compaction is held. (Unlinked after the load, a compaction begun before the unlink could
        # fold the whole load and leave nothing for a held one to do: seen on a loaded machine.)
        gate.unlink()
        client.post("/v1/events", content=chains(1000), headers=NDJSON)  # far larger than the image: compacted
        written(client)
        expected = pairs(client)

        def held() -> list[int]:
            running = _compacting(proc.pid)
            return [pid for pid in (int(p.name.rsplit(".", 1)[1]) for p in gate.parent.glob("fold.held.*"))
                    if pid in running]

        child = eventually(held, "a compaction of the new events, held", timeout=120)[0]
        proc.kill()
        proc.wait()
        eventually(lambda: not _alive(child), "the child dead with it", timeout=60)
    gate.touch()
    with serving(tmp_path) as (proc, client):
        assert pairs(client) == expected
