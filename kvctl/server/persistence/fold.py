"""The compaction child: `python -m kvctl.server.persistence.fold STATE_DIR --upto CUT --block-size N --parent PID`
(see `compact`). It restores the last image plus the log segments before CUT in its own memory, writes the
next image with `log_from` = CUT, and deletes the segments neither image needs any more.

Its first act is to die with the router (PR_SET_PDEATHSIG), so that no orphan deletes segments under the next
router's restore; the imports that take most of a second come after it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvctl.server.persistence.fold", description=__doc__)
    parser.add_argument("state_dir", type=Path)
    parser.add_argument("--upto", type=int, required=True, help="the first segment not to fold in")
    parser.add_argument("--block-size", type=int, required=True, help="the router's default block size")
    parser.add_argument("--parent", type=int, help="the router: this process dies with it")
    args = parser.parse_args(argv)
    if args.parent is not None and not _dies_with(args.parent):
        print("not compacted: the router is gone", file=sys.stderr)
        return 1
    from kvctl.server.persistence import (  # noqa: PLC0415
        replay,
        segments,
        snapshot,  # noqa: PLC0415 (after PR_SET_PDEATHSIG: see the module's docstring)
    )
    from kvctl.server.state import Fleet  # noqa: PLC0415

    fleet = Fleet(block_size=args.block_size)
    done = replay.restore(fleet, args.state_dir, time.monotonic(), upto=args.upto)
    for problem in done.problems:
        print(f"damaged image: {problem}", file=sys.stderr)
    if done.stopped is not None:  # the router restored the same way: its start set the damage aside
        print(f"not compacted: the log is damaged at {done.stopped}", file=sys.stderr)
        return 1
    path = snapshot.write(snapshot.capture(fleet, time.time(), log_from=args.upto, log_pos=done.position),
                          args.state_dir)
    deleted = segments.delete_before(args.state_dir, done.log_from)
    print(json.dumps({"image": path.name, "records": done.records, "segments_deleted": deleted}))
    return 0


def _dies_with(parent: int) -> bool:
    """Be killed when the router dies; False when it is gone already."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    return os.getppid() == parent


if __name__ == "__main__":
    sys.exit(main())
