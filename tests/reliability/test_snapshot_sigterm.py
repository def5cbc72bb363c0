"""SIGTERM while the state log is being compacted (issue 22, item 4; issue 27): the stop only flushes and
fsyncs the log, a compaction child in flight is dropped, and every stop leaves files that restore the whole
index, with nothing set aside as damaged."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

from kvctl.server.persistence import replay
from kvctl.server.state import Fleet
from tests.reliability.test_snapshot_kill import blocks, chains
from tests.reliability.test_state_log import OFTEN
from tests.server.test_serve_process import _stop, serving

STOPS = 10


def test_every_sigterm_leaves_files_that_restore_the_whole_index(tmp_path: Path) -> None:
    with serving(tmp_path) as (proc, client):
        answer = client.post("/v1/events", content=chains(300), headers={"content-type": "application/x-ndjson"})
        assert answer.json()["rejected"] == {}
        held = blocks(client)
        _stop(proc)
    rng = random.Random(22)
    failures: dict[int, list[str]] = {}
    for stop in range(STOPS):
        with serving(tmp_path, *OFTEN) as (proc, client):
            assert blocks(client) == held
            time.sleep(rng.uniform(0.05, 0.3))  # compactions back to back: one is nearly always in flight
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
            log = proc.stderr.read()  # type: ignore[union-attr]
        if problems := _unsound(tmp_path, held, log):
            failures[stop] = problems
    assert failures == {}, f"{len(failures)} of {STOPS} stops left files that do not restore: {failures}"


def _unsound(state_dir: Path, held: int, log: str) -> list[str]:
    """What is wrong with the files a stop left: empty when they restore everything, undamaged."""
    problems = [line for line in log.splitlines() if "state log" in line and "failed" in line]
    done = replay.restore(fleet := Fleet(block_size=16), state_dir, 0.0)
    problems += done.problems
    if done.stopped is not None or done.torn:
        problems.append(f"log damaged: {done.stopped or 'torn tail'}")
    if (got := fleet.stats().models["default"].blocks) != held:
        problems.append(f"restored {got} of {held} blocks")
    return problems
