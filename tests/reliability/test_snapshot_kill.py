"""A router killed with SIGKILL at random moments while it rewrites its snapshot over and over: every
restart finds a sound snapshot holding the whole index, and no file is ever left damaged."""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

from kvctl.core.hashing import local_block_hashes, sequence_hashes
from tests.server.test_serve_process import serving

KILLS = 8


def chains(count: int, blocks: int = 64, start: int = 0) -> str:
    """RouterEvent JSON lines: `count` unrelated chains of `blocks` blocks (numbered from `start`), on 4 workers."""
    lines = []
    for n in range(start, start + count):
        local = local_block_hashes([n * 100_000 + t for t in range(blocks * 16)], 16)
        stored = [{"block_hash": s, "tokens_hash": h} for s, h in zip(sequence_hashes(local), local, strict=True)]
        lines.append(json.dumps({"worker_id": n % 4, "event": {"event_id": n, "data": {"stored": {
            "parent_hash": None, "blocks": stored}}}}))
    return "\n".join(lines)


def blocks(client: object) -> int:
    return int(client.get("/v1/tree/stats").json()["models"]["default"]["blocks"])  # type: ignore[attr-defined]


def test_sigkill_during_snapshot_writes_never_leaves_the_state_dir_corrupt(tmp_path: Path) -> None:
    with serving(tmp_path) as (proc, client):
        answer = client.post("/v1/events", content=chains(300), headers={"content-type": "application/x-ndjson"})
        assert answer.json()["rejected"] == {}
        held = blocks(client)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    rng = random.Random(7)
    for _ in range(KILLS):
        with serving(tmp_path, "--snapshot-interval", "0.001") as (proc, client):
            assert blocks(client) == held  # restored whole, from the newest or the previous snapshot
            time.sleep(rng.uniform(0.0, 0.4))  # somewhere in a write, a rename, or between two
            proc.kill()
            proc.wait()
        assert not list(tmp_path.glob("*.damaged")), "a kill left a snapshot damaged"
    with serving(tmp_path) as (proc, client):
        assert blocks(client) == held
