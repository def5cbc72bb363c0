"""Holds put into a `kvctl serve` process (or its compaction child) that a test starts, so that the test sees a
state that otherwise lasts only as long as the machine is slow: a restore not finished, a compaction running.

Python imports this module at start-up from a PYTHONPATH that names this folder (`holding` sets it). Each hold
is a barrier, not a timer: the process waits until the test creates the gate file, however loaded the machine.
  KVCTL_TEST_HOLD_RESTORE=GATE  the router's restore, its index loaded, waits before the router says ready;
  KVCTL_TEST_HOLD_FOLD=GATE     the compaction child, past PR_SET_PDEATHSIG, waits before it reads the state dir
                                (and says so with a file GATE.held.PID).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def _hold_restore(gate: Path) -> None:
    import asyncio  # noqa: PLC0415 (only in the process held)

    from kvctl.server import daemon  # noqa: PLC0415

    restore = daemon._restore

    async def held(*args: object, **kwargs: object) -> object:
        restored = await restore(*args, **kwargs)  # type: ignore[arg-type]
        while not gate.exists():
            await asyncio.sleep(0.01)
        return restored

    daemon._restore = held  # type: ignore[assignment]


def _hold_fold(gate: Path) -> None:
    from kvctl.server.persistence import replay  # noqa: PLC0415

    restore = replay.restore

    def held(*args: object, **kwargs: object) -> object:
        if not gate.exists():
            Path(f"{gate}.held.{os.getpid()}").touch()  # the test's sign that this child is held
        while not gate.exists():
            time.sleep(0.01)
        return restore(*args, **kwargs)  # type: ignore[arg-type]

    replay.restore = held  # type: ignore[assignment]


if (restore_gate := os.environ.get("KVCTL_TEST_HOLD_RESTORE")) and "serve" in sys.orig_argv:
    _hold_restore(Path(restore_gate))
if (fold_gate := os.environ.get("KVCTL_TEST_HOLD_FOLD")) and "kvctl.server.persistence.fold" in sys.orig_argv:
    _hold_fold(Path(fold_gate))
