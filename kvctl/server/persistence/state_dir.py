"""A router's hold on its state dir: one `kvctl serve` per directory, and one that can write there.

Two routers in one state dir delete each other's temporary files and replace each other's snapshots, so
a router takes an exclusive lock on `router.lock` for its whole life (flock: the kernel lets go when the
process dies, SIGKILL included, so a lock is never stale) and writes its pid and URL into it, for the
line a second router exits with. Whether the directory can be written is checked at the same moment: a
router that cannot snapshot says so at start, not at its first snapshot or its last.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from pathlib import Path
from types import TracebackType

from kvctl.errors import StateDirError

LOCK = "router.lock"


def unwritable(state_dir: Path, exc: OSError) -> StateDirError:
    return StateDirError(f"--state-dir {state_dir} is not a writable directory: {exc.strerror or exc}",
                         hint="pass a writable --state-dir")


class StateDirLock:
    """Held until `release` (or the process ends); `record` says where the holder serves."""

    def __init__(self, state_dir: Path, fd: int) -> None:
        self.state_dir = state_dir
        self._fd = fd

    def record(self, url: str) -> None:
        holder = json.dumps({"pid": os.getpid(), "url": url}).encode() + b"\n"
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, holder, 0)

    def release(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> StateDirLock:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def claim(state_dir: Path, listen: str) -> StateDirLock:
    """Create the state dir if needed, lock it and check it can be written; raises StateDirError."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(state_dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise unwritable(state_dir, exc) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid, url = _holder(fd)
        os.close(fd)
        raise StateDirError(f"--state-dir {state_dir} is in use by kvctl serve pid {pid} ({url})",
                            hint=f"pass another --state-dir, or stop pid {pid}") from None
    held = StateDirLock(state_dir, fd)
    try:
        held.record(listen)
        probe, name = tempfile.mkstemp(dir=state_dir, prefix=".write-probe.")
        os.close(probe)
        os.unlink(name)
    except OSError as exc:  # a lock file left writable in a directory that is not, or a read-only mount
        held.release()
        raise unwritable(state_dir, exc) from None
    return held


def _holder(fd: int) -> tuple[str, str]:
    """The pid and URL the holder recorded; '?' for what it has not written yet."""
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        holder = json.loads(os.pread(fd, 4096, 0))
        return str(int(holder["pid"])), str(holder["url"])
    return "?", "?"
