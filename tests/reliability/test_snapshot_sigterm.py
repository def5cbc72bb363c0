"""SIGTERM while periodic snapshots are being written (issue 22, item 4): the final snapshot waits for
the one in flight instead of writing the same file beside it, so every stop leaves a whole snapshot,
taken after the signal, that restores the whole index."""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

from kvctl.server import snapshot
from kvctl.server.state import Fleet
from tests.reliability.test_snapshot_kill import blocks, chains
from tests.server.test_serve_process import _stop, serving

STOPS = 10


def test_every_sigterm_leaves_a_whole_final_snapshot(tmp_path: Path) -> None:
    with serving(tmp_path) as (proc, client):
        answer = client.post("/v1/events", content=chains(300), headers={"content-type": "application/x-ndjson"})
        assert answer.json()["rejected"] == {}
        held = blocks(client)
        _stop(proc)
    rng = random.Random(22)
    failures: dict[int, list[str]] = {}
    for stop in range(STOPS):
        with serving(tmp_path, "--snapshot-interval", "0.001") as (proc, client):
            assert blocks(client) == held
            time.sleep(rng.uniform(0.05, 0.3))  # periodic writes back to back: one is nearly always in flight
            signalled = time.time()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
            log = proc.stderr.read()  # type: ignore[union-attr]
        if problems := _unsound(tmp_path, held, signalled, log):
            failures[stop] = problems
    assert failures == {}, f"{len(failures)} of {STOPS} stops left no sound final snapshot: {failures}"


def _unsound(state_dir: Path, held: int, signalled: float, log: str) -> list[str]:
    """What is wrong with the snapshot a stop left: empty when it is whole, final and restores everything."""
    problems = [line for line in log.splitlines() if "snapshot" in line and "failed" in line]
    newest = state_dir / snapshot.FILENAME
    if not newest.exists():
        return [*problems, "no snapshot left"]
    with newest.open() as f:
        taken_at = json.loads(f.readline()).get("taken_at", 0.0)
    if taken_at < signalled:
        problems.append(f"the newest snapshot was taken {signalled - taken_at:.3f} s before SIGTERM")
    restored, damaged = snapshot.restore(fleet := Fleet(block_size=16), state_dir, 0.0)
    problems += damaged
    if restored is None or restored.path.name != snapshot.FILENAME:
        problems.append(f"restored from {restored and restored.path.name}")
    elif (got := fleet.stats().models["default"].blocks) != held:
        problems.append(f"restored {got} of {held} blocks")
    return problems
