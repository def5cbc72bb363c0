"""What a restore finds missing from the state dir (`persistence.gaps`): a write lost after the last fsync (a power
cut) is no loss, one lost before it is; a write that failed between two good ones is a gap inside its segment; a
state dir written before the marks restores without a false alarm, and the log goes on from it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from array import array
from pathlib import Path

from kvctl.core.events import Stored
from kvctl.server.persistence import records, replay, segments, snapshot
from kvctl.server.persistence.state_log import StateLog
from kvctl.server.state import Fleet

CHAIN = 8


def chain(n: int) -> Stored:
    return Stored(None, [n * 1000 + i for i in range(CHAIN)], array("Q", [n * 1000 + i for i in range(CHAIN)]))


def apply(fleet: Fleet, n: int) -> None:
    fleet.apply_engine_batch("default", (1, 0), [chain(n)], 0.0)


def restored(state_dir: Path) -> tuple[replay.Restore, Fleet]:
    fleet = Fleet()
    return replay.restore(fleet, state_dir, 0.0, repair=True), fleet


def test_a_write_lost_after_the_last_fsync_is_no_loss_one_before_it_is(tmp_path: Path) -> None:
    fleet = Fleet()
    state_log = StateLog(tmp_path, fleet, restored_from=None)
    for n in range(4):  # fsynced: acknowledged
        apply(fleet, n)
        state_log.flush(fsync=True).result()
    apply(fleet, 4)  # written, not fsynced
    state_log.flush(fsync=False).result()
    segment = segments.path(tmp_path, 0)
    offsets = [at for at, _ in records.read(segment, [])]

    power_cut = tmp_path / "power-cut"  # the disk as a power cut leaves it: the unsynced write half there
    shutil.copytree(tmp_path, power_cut)
    with segments.path(power_cut, 0).open("r+b") as f:
        f.truncate(offsets[-1] + 5)
    done, again = restored(power_cut)
    assert (done.torn, done.lost(again)) == (1, None)
    assert again.stats().models["default"].blocks == 4 * CHAIN

    cut = tmp_path / "cut"  # cut inside what was fsynced: chains 3 and 4 gone
    shutil.copytree(tmp_path, cut)
    with segments.path(cut, 0).open("r+b") as f:
        f.truncate(offsets[-2] + 5)
    done, again = restored(cut)
    lost = done.lost(again)
    assert lost is not None and lost.by_cause == {"cut_short": 1}
    assert lost.reason == (f"restored {3 * CHAIN} of {4 * CHAIN} blocks: 1 acknowledged state log record missing: "
                           f"state.log.00000000 cut short at byte {offsets[-2]:,} (it held {offsets[-1]:,}) "
                           "(records 5 to 5)")
    state_log.close()


FAILING_WRITE = """
import resource, sys
from array import array
from pathlib import Path
from kvctl.core.events import Stored
from kvctl.server.persistence import segments
from kvctl.server.persistence.state_log import StateLog
from kvctl.server.state import Fleet

state_dir = Path(sys.argv[1])
fleet = Fleet()
state_log = StateLog(state_dir, fleet, restored_from=None)
def write(n, fsync=True):
    fleet.apply_engine_batch("default", (1, 0), [Stored(None, [n * 1000 + i for i in range(8)],
                                                         array("Q", [n * 1000 + i for i in range(8)]))], 0.0)
    state_log.flush(fsync=fsync).result()
for n in range(3):
    write(n)
room = segments.path(state_dir, 0).stat().st_size
resource.setrlimit(resource.RLIMIT_FSIZE, (room, resource.RLIM_INFINITY))  # the disk is full
write(3)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))  # room again
write(4)
state_log.close()
print(state_log.stats.write_errors, room)
"""


def test_a_write_that_failed_between_good_ones_is_a_gap_inside_its_segment(tmp_path: Path) -> None:
    """The writer cuts a failed write back, so the next one follows the last good one: only the marks tell."""
    out = subprocess.run([sys.executable, "-c", FAILING_WRITE, str(tmp_path)], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    errors, room = map(int, out.split())
    assert errors == 1
    done, fleet = restored(tmp_path)
    lost = done.lost(fleet)
    assert lost is not None and lost.by_cause == {"write_failed": 1}
    assert lost.reason == (f"restored {4 * CHAIN} of {5 * CHAIN} blocks: 1 acknowledged state log record missing: "
                           f"state.log.00000000 at byte {room:,}, a write that failed (records 5 to 5)")


def test_a_state_dir_from_before_the_marks_restores_whole_and_the_log_goes_on(tmp_path: Path) -> None:
    old = Fleet()
    apply(old, 0)
    snapshot.write(snapshot.capture(old, 1.0, log_from=0), tmp_path)  # an image that says no position
    frame = bytearray()
    records.frame_into(frame, [(records.BATCH, "default", 1, 0, [{"parent_hash": None, "block_hashes": [99],
                                                                  "tokens_hashes": [99]}])])
    segments.path(tmp_path, 0).write_bytes(bytes(frame))  # a frame without a mark
    done, fleet = restored(tmp_path)
    assert done.lost(fleet) is None and done.records == 1

    state_log = StateLog(tmp_path, fleet, restored_from=0, position=done.position)
    apply(fleet, 1)
    state_log.close()
    done, again = restored(tmp_path)
    assert done.lost(again) is None
    assert again.stats().models["default"].blocks == 2 * CHAIN + 1
