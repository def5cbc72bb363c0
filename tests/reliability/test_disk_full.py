"""The state dir fills up under a running `kvctl serve` (issue 11): the periodic snapshot fails with a
log line naming the state dir and the errno, the router goes on routing and taking events, the last
good snapshot stays as it was, and once there is room again the next snapshot holds everything.

"Full" is the router's file size limit (RLIMIT_FSIZE, set on the running process with prlimit):
Python ignores SIGXFSZ, so a write past the limit fails with EFBIG, as one on a full disk fails with
ENOSPC, and the limit can be lifted again from outside to model space coming back.
"""

from __future__ import annotations

import json
import resource
import signal
import time
from pathlib import Path
from typing import Any

import httpx

from kvctl.core.hashing import local_block_hashes, sequence_hashes
from tests.reliability.test_engine_faults import router
from tests.support import eventually
from tests.support.served import on_both_route_paths

LIMIT = 64 * 1024  # bytes: far below a snapshot of the index below, far above the log file
FAILED = "snapshot to {state} failed: [Errno 27] File too large"


def chains(first: int, count: int, blocks: int = 64) -> str:
    """RouterEvent JSON lines: chains first..first+count-1 of `blocks` blocks each, spread over 4 workers."""
    lines = []
    for n in range(first, first + count):
        local = local_block_hashes([n * 100_000 + t for t in range(blocks * 16)], 16)
        stored = [{"block_hash": s, "tokens_hash": h} for s, h in zip(sequence_hashes(local), local, strict=True)]
        lines.append(json.dumps({"worker_id": n % 4, "event": {"event_id": n, "data": {"stored": {
            "parent_hash": None, "blocks": stored}}}}))
    return "\n".join(lines)


def post(client: httpx.Client, body: str) -> None:
    answer = client.post("/v1/events", content=body, headers={"content-type": "application/x-ndjson"}).json()
    assert answer["applied"] == len(body.splitlines()) and answer["rejected"] == {}, answer


def held(client: httpx.Client) -> set[tuple[int, int, int]]:
    return {(ev["worker_id"], b["block_hash"], b["tokens_hash"]) for ev in client.get("/v1/tree").json()
            for b in ev["event"]["data"]["stored"]["blocks"]}


def taken_at(state: Path) -> float:
    try:
        with (state / "snapshot.jsonl").open() as f:
            return float(json.loads(f.readline())["taken_at"])
    except (OSError, ValueError, KeyError):
        return 0.0


def snapshot_after(state: Path, moment: float) -> None:
    eventually(lambda: taken_at(state) > moment, "a snapshot taken after that moment")


def route_overlap(client: httpx.Client, chain: int) -> Any:
    return client.post("/v1/route", json={"token_ids": [chain * 100_000 + t for t in range(64 * 16)]}).json()


def set_file_limit(pid: int, limit: int) -> None:
    _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit, hard))


@on_both_route_paths
def test_full_state_dir_fails_snapshots_loudly_and_the_router_keeps_serving(tmp_path: Path) -> None:
    state = tmp_path / "state"
    failed = FAILED.format(state=state)
    with router(state, "--snapshot-interval", "0.2") as (proc, client, log):
        post(client, chains(0, 40))
        moment = time.time()
        snapshot_after(state, moment)

        set_file_limit(proc.pid, LIMIT)  # the disk is full
        eventually(lambda: failed in log.read_text(), "a failed snapshot, logged")
        good = {p.name: p.read_bytes() for p in state.iterdir()}  # the last snapshot that made it
        assert good["snapshot.jsonl"].count(b"\n") == 1 + 40 + 1  # header, the 40 chains, trailer
        post(client, chains(40, 40))  # still taken
        eventually(lambda: log.read_text().count(failed) >= 3, "more failed snapshots")
        fds = len(list(Path(f"/proc/{proc.pid}/fd").iterdir()))
        eventually(lambda: log.read_text().count(failed) >= 7, "yet more failed snapshots")
        assert len(list(Path(f"/proc/{proc.pid}/fd").iterdir())) == fds  # a failed write leaks no file
        assert proc.poll() is None
        assert {p.name: p.read_bytes() for p in state.iterdir()} == good  # intact, and no half-written file
        answer = route_overlap(client, 50)  # routes on what came in while full
        assert answer["overlap_blocks"] == 64 and answer["worker_id"] == 50 % 4, answer
        assert client.get("/healthz").json()["status"] == "ok"

        set_file_limit(proc.pid, resource.RLIM_INFINITY)  # room again
        moment = time.time()
        snapshot_after(state, moment)
        before = held(client)
        assert len(before) == 80 * 64
        proc.send_signal(signal.SIGKILL)  # no final snapshot: only the periodic one counts
        proc.wait(10)
    assert not list(state.glob(".*.tmp"))
    with router(state) as (proc, client, log):
        after = held(client)
        lost = len(before - after)
        print(f"FAULT disk-full lost={lost} (of {len(before)} blocks, after a SIGKILL once there was room again; "
              f"{log.read_text().count(failed)} snapshots failed while full)")
        assert after == before

        # Full again, and the router is stopped before there is room: the final snapshot fails with the
        # same clear error, the router still exits cleanly, and a restart has the last good snapshot:
        # what came in since (exactly the 10 chains below) is what is lost.
        good = (state / "snapshot.jsonl").read_bytes()
        set_file_limit(proc.pid, LIMIT)
        post(client, chains(80, 10))
        with_late = held(client)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    assert f"final snapshot to {state} failed: [Errno 27] File too large" in log.read_text()
    assert (state / "snapshot.jsonl").read_bytes() == good
    with router(state) as (proc, client, log):
        restored = held(client)
        lost = len(with_late - restored)
        print(f"FAULT disk-full-then-stop lost={lost} (of {len(with_late)} blocks: the 10 chains taken while the "
              f"disk was full and the router was stopped before there was room again)")
        assert restored == before and lost == 10 * 64
