"""How far the state log is acknowledged: `state.log.acked`, one small record rewritten in place.

A segment cut short or deleted, or writes that failed on a full disk, leave no trace in the segments that are
left, so a restart can tell a log that was lost at its end from one that simply ended only if something else says
where it ended. The writer thread rewrites this record after each fsync of the log (the changes up to there are
acknowledged: a power loss keeps them) and after each write that failed (those changes were acknowledged to the
router's clients and will never be in the log). It is written over bytes the file already holds, so it takes no
new room: on a full ext4 or XFS disk it is the write that still succeeds.
"""

from __future__ import annotations

import contextlib
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from kvctl.server.persistence.snapshot import fsync_dir

FILENAME = "state.log.acked"
_RECORD = struct.Struct(">QQQQ?")  # end, blocks, segment, offset, failed; then the CRC-32 of those bytes
_CRC = struct.Struct(">I")
SIZE = _RECORD.size + _CRC.size


@dataclass(frozen=True, slots=True)
class Acked:
    """The log must hold the changes before position `end`; the index then held `blocks` device blocks."""

    end: int
    blocks: int
    segment: int  # the segment written to then
    offset: int  # its length then (after a failed write: before it)
    failed: bool = False  # the last changes up to `end` were lost in a write that failed, not cut off since


def read(state_dir: Path) -> tuple[Acked | None, str | None]:
    """The record (None: there is none yet), or what is wrong with it."""
    path = state_dir / FILENAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"{path}: unreadable ({exc.strerror})"
    if data[:SIZE] == bytes(SIZE):  # made, never written to: no fsync came before the router stopped
        return None, None
    if len(data) < SIZE or _CRC.unpack_from(data, _RECORD.size)[0] != zlib.crc32(data[:_RECORD.size]):
        return None, f"{path}: damaged (checksum mismatch)"
    return Acked(*_RECORD.unpack_from(data)), None


class File:
    """The record, open for rewriting; made (zeros, fsynced) at once, so that later writes need no room."""

    def __init__(self, state_dir: Path) -> None:
        path = state_dir / FILENAME
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(self._fd).st_size < SIZE:
                os.pwrite(self._fd, bytes(SIZE), 0)
                os.fsync(self._fd)
                fsync_dir(state_dir)
        except OSError:
            os.close(self._fd)
            raise

    def write(self, acked: Acked) -> None:
        """Rewrite the record and fsync it (OSError as the disk gives it)."""
        record = _RECORD.pack(acked.end, acked.blocks, acked.segment, acked.offset, acked.failed)
        os.pwrite(self._fd, record + _CRC.pack(zlib.crc32(record)), 0)
        os.fsync(self._fd)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)
