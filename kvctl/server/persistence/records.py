"""What the state log holds, and how it is framed on disk.

A record is msgpack (an array whose first item says what it is), framed as `length, crc32` (big-endian
u32 each) then the payload: a record cut short by a kill is told from one that rotted in the middle.
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

MODEL, WORKER, UNREGISTER, BATCH = 0, 1, 2, 3
HEAD = struct.Struct(">II")


def _bytes_of(value: Any) -> Any:
    if isinstance(value, array):
        return value.tobytes()
    raise NotImplementedError(f"cannot log {type(value).__name__}")


encode = msgspec.msgpack.Encoder(enc_hook=_bytes_of).encode
_decode = msgspec.msgpack.Decoder().decode


def frames(payloads: Sequence[bytes]) -> bytes:
    """Payloads framed for the file, in one buffer (built off the loop, by the writer thread)."""
    pack, crc32 = HEAD.pack, zlib.crc32
    return b"".join([part for payload in payloads for part in (pack(len(payload), crc32(payload)), payload)])


@dataclass(frozen=True, slots=True)
class Scan:
    """How reading a segment ended: `good` bytes of whole records, then nothing (clean), a record cut
    short at the end (`torn`: a kill mid-write), or a damaged one with more after it (`corrupt`)."""

    good: int
    torn: bool = False
    corrupt: str | None = None


def read(path: Path, scan: list[Scan]) -> Iterator[tuple[int, list[Any]]]:
    """(offset, record) for each record of one segment, in order; how the read ended is appended to `scan`."""
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
            record = _decode(payload)
            if not isinstance(record, list) or not record or record[0] not in (MODEL, WORKER, UNREGISTER, BATCH):
                raise ValueError("not a state-log record")
        except (msgspec.DecodeError, ValueError) as exc:
            scan.append(Scan(at, corrupt=f"undecodable record at byte {at}: {exc}"))
            return
        yield at, record
        at = stop
    scan.append(Scan(at))


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
