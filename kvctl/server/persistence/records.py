"""What the state log holds, and how it is framed on disk.

A record is msgpack (an array whose first item says what it is). Each write's frame begins with a MARK record
`[MARK, first, count, blocks]`: the position of its first change in the state dir's count of changes (which goes on
across restarts and images), how many it holds, and the device blocks the index held once they were applied. A
restore follows the positions from frame to frame, so a frame, a segment or a run of segments that went missing
shows as a gap of known size (`gaps`); frames written before the MARK carry none.

Frames are `length, crc32` (big-endian u32 each) then the payload: a frame cut short by a kill is told from one
that rotted in the middle. The writer thread frames each write as one payload holding the list of its records
(`frame_into`): one encode and one CRC per write, none per change, and no work for the loop but keeping the change.
A frame holding a single record is what the first version wrote, one per change; both are read.
Hash arrays the decode process hands over (`array('Q')`) are written as their bytes, in this machine's
byte order: a state dir is not moved across architectures.
"""

from __future__ import annotations

import struct
import zlib
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from kvctl.core.events import Cleared, EventData, Removed, Stored, Tier
from kvctl.core.names import MAX_DP_RANK, MAX_WORKER_ID, SeqMark

MODEL, WORKER, UNREGISTER, BATCH, DROPPED, SEQS, MARK = 0, 1, 2, 3, 4, 5, 6
KINDS = (MODEL, WORKER, UNREGISTER, BATCH, DROPPED, SEQS, MARK)
HEAD = struct.Struct(">II")


def _bytes_of(value: Any) -> Any:
    if isinstance(value, array):
        return value.tobytes()
    raise NotImplementedError(f"cannot log {type(value).__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_bytes_of)
_decode = msgspec.msgpack.Decoder().decode


def frame_into(buffer: bytearray, records: Sequence[Any]) -> None:
    """`records` as one frame in `buffer` (replacing what it held): built by the writer thread, in a buffer it
    reuses, and the CRC of a large payload runs without the GIL."""
    _encoder.encode_into(records, buffer, HEAD.size)
    with memoryview(buffer) as view:
        HEAD.pack_into(buffer, 0, len(buffer) - HEAD.size, zlib.crc32(view[HEAD.size:]))


@dataclass(frozen=True, slots=True)
class Scan:
    """How reading a segment ended: `good` bytes of whole records, then nothing (clean), a record cut
    short at the end (`torn`: a kill mid-write), or a damaged one with more after it (`corrupt`)."""

    good: int
    torn: bool = False
    corrupt: str | None = None


def read(path: Path, scan: list[Scan]) -> Iterator[tuple[int, list[list[Any]]]]:
    """(offset, records) for each frame of one segment, in order; how the read ended is appended to `scan`."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:  # deleted since it was listed: a compaction folded it into the image
        scan.append(Scan(0))
        return
    at, end = 0, len(data)
    while at < end:
        if at + HEAD.size > end:
            scan.append(Scan(at, torn=True))
            return
        length, crc = HEAD.unpack_from(data, at)
        start, stop = at + HEAD.size, at + HEAD.size + length
        if stop > end:
            scan.append(Scan(at, torn=True))
            return
        payload = data[start:stop]
        if zlib.crc32(payload) != crc:
            scan.append(Scan(at, torn=True) if stop == end else Scan(at, corrupt=f"checksum mismatch at byte {at}"))
            return
        try:
            found = _records_of(_decode(payload))
        except (msgspec.DecodeError, ValueError) as exc:
            scan.append(Scan(at, corrupt=f"undecodable record at byte {at}: {exc}"))
            return
        yield at, found
        at = stop
    scan.append(Scan(at))


def _records_of(payload: Any) -> list[list[Any]]:
    """A frame's records: the list it holds, or the one record it is (the first version's frames)."""
    if isinstance(payload, list) and payload and not isinstance(payload[0], list):
        payload = [payload]
    if not isinstance(payload, list) or not all(isinstance(r, list) and r and r[0] in KINDS for r in payload):
        raise ValueError("not a state-log record")
    return payload


def _hashes(value: Any) -> Sequence[int]:
    if isinstance(value, bytes):
        hashes = array("Q")
        hashes.frombytes(value)
        return hashes
    if not isinstance(value, list):
        raise ValueError(f"hashes must be a list or bytes, got {type(value).__name__}")
    return value


def event_of(item: Any) -> EventData:
    """One logged event back as the index takes it (ValueError, KeyError or TypeError when malformed)."""
    if not isinstance(item, dict):
        raise ValueError("an event must be a map")
    if not item:
        return Cleared()
    tier = Tier(item.get("tier", Tier.device.value))
    if "parent_hash" in item:
        return Stored(item["parent_hash"], list(_hashes(item["block_hashes"])), _hashes(item["tokens_hashes"]), tier)
    return Removed(_hashes(item["block_hashes"]), tier)


def seq_mark(item: Any) -> SeqMark:
    """One `[worker_id, dp_rank, endpoint, seq]` of a SEQS record back as a `SeqMark` (ValueError when malformed)."""
    worker_id, dp_rank, endpoint, seq = item
    if not (isinstance(endpoint, str) and all(isinstance(n, int) for n in (worker_id, dp_rank, seq))
            and 0 <= worker_id <= MAX_WORKER_ID and 0 <= dp_rank <= MAX_DP_RANK and 0 <= seq < 2**64):
        raise ValueError(f"not a stream seq: {item!r}")
    return ((worker_id, dp_rank), endpoint), seq


@dataclass(frozen=True, slots=True)
class Mark:
    """A frame's MARK: its changes are positions `first` to `first + count - 1`; the index then held `blocks`."""

    first: int
    count: int
    blocks: int

    @property
    def end(self) -> int:
        return self.first + self.count


def mark_of(record: Any) -> Mark | None:
    """The MARK a frame begins with, or None for a frame written before there were marks (ValueError when
    malformed)."""
    if record[0] != MARK:
        return None
    _, first, count, blocks = record
    if not all(isinstance(n, int) and 0 <= n < 2**63 for n in (first, count, blocks)):
        raise ValueError(f"not a frame mark: {record!r}")
    return Mark(first, count, blocks)
