"""Compaction: a child process folds the log into a new image, so the router's loop never holds the index
for it (the role of Redis's BGSAVE and of etcd's snapshot beside its WAL).

The router rotates the log to a new segment (the cut), then runs `python -m kvctl.server.persistence.fold
STATE_DIR --upto CUT`: it restores the last image plus the segments before the cut in its own memory,
writes the result as the next image (`snapshot.write`: atomic, `.prev` kept, checksummed) with `log_from`
= CUT, and deletes the segments that neither image needs any more. Killed at any point, it leaves the
files a restore takes as they were.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import time

from kvctl.child_process import python_module
from kvctl.server.persistence import fold, snapshot
from kvctl.server.persistence.state_log import FLUSH_S, StateLog
from kvctl.server.state import Fleet

log = logging.getLogger("kvctl.serve")

COMPACT_BYTES = 64 << 20  # the least log that is worth a new image (`--compact-log-bytes`)


def due(state_log: StateLog, compact_bytes: int) -> bool:
    """Compact once the log after the image is as large as the image and at least `compact_bytes`: the
    disk written stays within twice what changed, and a restore replays at most about an image's worth."""
    image = state_log.state_dir / snapshot.FILENAME
    image_bytes = image.stat().st_size if image.exists() else 0
    return state_log.stats.since_image >= max(compact_bytes, image_bytes, 1)


async def keep(state_log: StateLog, fleet: Fleet, *, interval_s: float, compact_bytes: int,
               block_size: int) -> None:
    """The log's background duties: written every `FLUSH_S` at most, fsynced and compaction considered every
    `interval_s` (`--snapshot-interval`), an image of the fleet itself after lost writes (at once after a restore
    that lost some: the state dir then starts from what the router holds). Cancelled at shutdown; a compaction
    child then is killed."""
    next_sync = time.monotonic() + (0.0 if state_log.stats.lost else interval_s)
    compacting: asyncio.Task[bool] | None = None
    try:
        while True:
            await asyncio.sleep(min(FLUSH_S, interval_s))
            sync = time.monotonic() >= next_sync
            state_log.flush(fsync=sync)
            if sync:
                next_sync = time.monotonic() + interval_s
                if state_log.stats.lost and (compacting is None or compacting.done()):
                    await image_after_loss(state_log, fleet)
                elif (compacting is None or compacting.done()) and due(state_log, compact_bytes):
                    compacting = asyncio.create_task(compact(state_log, block_size))
    finally:
        if compacting is not None and not compacting.done():
            compacting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await compacting


async def image_after_loss(state_log: StateLog, fleet: Fleet) -> None:
    """After a failed write (a full disk) the log misses changes, so only the fleet itself holds them: its
    image is captured on the loop (the one O(index) pause left, and only after a fault) at a cut of the
    log and written by a thread; until that succeeds it is retried every interval."""
    state_log.stats.lost = False
    cut, rotated = state_log.rotate()
    taken = snapshot.capture(fleet, time.time(), log_from=cut, log_pos=state_log.position)
    at_cut = await asyncio.wrap_future(rotated)
    try:
        await asyncio.to_thread(snapshot.write, taken, state_log.state_dir)
    except OSError as exc:
        state_log.stats.lost = True
        log.error("state log: image after lost writes to %s failed: %s", state_log.state_dir, exc)
        return
    state_log.stats.images_after_loss += 1
    state_log.image_from(at_cut)
    partial = fleet.health.faults.get("state_dir")
    if partial is not None:  # restored less than acknowledged: the image holds what there is, not what was
        log.info("state log: wrote an image of the index as restored (partial: %s); the next restart starts "
                 "from it", partial.reason)
    else:
        log.warning("state log: wrote an image of the whole index after lost writes; the log is whole again")


async def compact(state_log: StateLog, block_size: int) -> bool:
    """Rotate the log and let a child write the next image; True when it did."""
    cut, rotated = state_log.rotate()
    at_cut = await asyncio.wrap_future(rotated)
    started = time.monotonic()
    # Started and waited for by threads, not the loop's own spawn: uvloop's forks the router, copying the
    # page tables of its whole index with the loop held (~30 ms per 400 MB resident); CPython's vforks.
    proc = await asyncio.to_thread(
        subprocess.Popen,
        [*python_module(fold.__name__), str(state_log.state_dir), "--upto", str(cut), "--block-size", str(block_size),
         "--parent", str(os.getpid())],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        out, err = await asyncio.to_thread(proc.communicate)
    finally:
        if proc.returncode is None:  # cancelled (shutdown): the image it was writing is not needed
            proc.kill()
            await asyncio.to_thread(proc.wait)
    stats = state_log.stats
    if proc.returncode != 0:
        stats.compaction_failures += 1
        log.error("state log compaction failed (exit %s): %s", proc.returncode, err.decode(errors="replace")[-500:])
        return False
    stats.compactions += 1
    state_log.image_from(at_cut)
    stats.last_compaction_s = round(time.monotonic() - started, 3)
    log.info("state log compacted in %.2f s (pid %d): %s", stats.last_compaction_s, proc.pid, out.decode().strip())
    return True
