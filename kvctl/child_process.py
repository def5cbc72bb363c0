"""How kvctl starts a Python child of its own: the installed kvctl, whatever the working directory.

`python -m pkg` puts the working directory first on `sys.path`, so run from the folder that holds a checkout it
imports the source tree (uncompiled, perhaps another version) instead of the installed package; `-P` (3.11+)
leaves the working directory out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence


def python_module(module: str) -> list[str]:
    """argv that runs `module` with this interpreter and the kvctl it has installed."""
    return [sys.executable, "-P", "-m", module]


@contextlib.asynccontextmanager
async def kvctl_child(args: Sequence[str], what: str, *, start_s: float = 30.0,
                     stop_s: float = 10.0) -> AsyncIterator[tuple[asyncio.subprocess.Process, bytes]]:
    """`kvctl ARGS` as a child whose first stdout line announces it (a URL, a JSON row list); yields the process
    and that line. On exit it is stopped: SIGTERM, then SIGKILL after `stop_s`."""
    proc = await asyncio.create_subprocess_exec(
        *python_module("kvctl"), *args, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), start_s)
        if not line.strip():
            raise RuntimeError(f"{what} did not start (exit {await proc.wait()})")
        yield proc, line
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), stop_s)
            except TimeoutError:
                proc.kill()
                await proc.wait()
