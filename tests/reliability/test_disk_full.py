"""The state dir fills up under a running `kvctl serve` (issues 11 and 27): state log writes fail with a log
line naming the file and the errno, the router goes on routing and taking events, no half record is left,
and once there is room again an image of the whole index makes the state dir whole.

"Full" is the router's file size limit (RLIMIT_FSIZE, set on the running process with prlimit):
Python ignores SIGXFSZ, so a write past the limit fails with EFBIG, as one on a full disk fails with
ENOSPC, and the limit can be lifted again from outside to model space coming back.
"""

from __future__ import annotations

import json
import resource
import signal
from pathlib import Path
from typing import Any

import httpx

from kvctl.core.hashing import local_block_hashes, sequence_hashes
from kvctl.server.persistence import records, segments
from tests.reliability.test_engine_faults import router
from tests.support import eventually
from tests.support.served import on_both_route_paths

FAILED = "changes not written, a restart will not have them: [Errno 27] File too large"
WHOLE = "wrote an image of the whole index after lost writes"


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


def full(client: httpx.Client, state: Path, pid: int, log: Path, first: int) -> int:
    """Post chains from `first` on until the newest state log segment outgrows the router's own log file, then
    leave it no room: it may not grow (the log file still may). Returns the next chain number."""
    def newest() -> int:
        return segments.path(state, segments.numbers(state)[-1]).stat().st_size
    while newest() <= log.stat().st_size + 64 * 1024:
        post(client, chains(first, 40))
        first += 40
        size = newest()
        eventually(newest, "the chains written", until=lambda n, size=size: n > size)
    set_file_limit(pid, newest())
    return first


def count(log: Path, line: str) -> int:
    return log.read_text().count(line)


def route_overlap(client: httpx.Client, chain: int) -> Any:
    return client.post("/v1/route", json={"token_ids": [chain * 100_000 + t for t in range(64 * 16)]}).json()


def set_file_limit(pid: int, limit: int) -> None:
    _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit, hard))


@on_both_route_paths
def test_full_state_dir_fails_log_writes_loudly_and_the_router_keeps_serving(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with router(state, "--snapshot-interval", "0.2") as (proc, client, log):
        following = full(client, state, proc.pid, log, 0)  # the disk is full
        fds = len(list(Path(f"/proc/{proc.pid}/fd").iterdir()))
        post(client, chains(following, 40))  # still taken
        eventually(lambda: count(log, FAILED), "a failed state log write, logged")
        eventually(lambda: count(log, "image after lost writes") >= 3, "failed images after the loss")
        assert len(list(Path(f"/proc/{proc.pid}/fd").iterdir())) == fds  # a failed write leaks no file
        assert proc.poll() is None
        answer = route_overlap(client, following)  # routes on what came in while full
        assert answer["overlap_blocks"] == 64 and answer["worker_id"] == following % 4, answer
        assert "kvctl_state_log_lost 1.0" in client.get("/metrics").text

        set_file_limit(proc.pid, resource.RLIM_INFINITY)  # room again
        eventually(lambda: count(log, WHOLE), "an image of the whole index")
        before = held(client)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert not list(state.glob(".*.tmp"))
    with router(state) as (proc, client, log):
        after = held(client)
        print(f"FAULT disk-full lost={len(before - after)} (of {len(before)} blocks, after a SIGKILL once there "
              f"was room again; {count(log, FAILED)} log writes failed while full)")
        assert after == before

        # Full again, and the router is stopped before there is room: the writes fail with the same clear
        # error, the router still exits cleanly, and a restart has what was written: what came in since
        # (exactly the 10 chains below) is what is lost.
        taken = count(log, FAILED)
        following = full(client, state, proc.pid, log, following + 40)
        before = held(client)
        post(client, chains(following, 10))
        with_late = held(client)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert count(log, FAILED) > taken
    for number in segments.numbers(state):  # a failed write is cut back: whole records only, everywhere
        scan: list[records.Scan] = []
        assert all(record for _, record in records.read(segments.path(state, number), scan))
        assert scan == [records.Scan(segments.path(state, number).stat().st_size)]
    with router(state) as (proc, client, log):
        restored = held(client)
        lost = len(with_late - restored)
        print(f"FAULT disk-full-then-stop lost={lost} (of {len(with_late)} blocks: the 10 chains taken while the "
              f"disk was full and the router was stopped before there was room again)")
        assert restored == before and lost == 10 * 64
