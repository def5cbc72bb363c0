"""The state log's framing (`persistence.records`): what the writer thread frames reads back the same, in both
formats (a frame per write, and the first version's frame per record), and a cut or damaged frame is told
apart and nothing after it is read; and a writer behind the disk drops changes the log and a restore say."""

from __future__ import annotations

import shutil
import threading
import zlib
from array import array
from pathlib import Path
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvctl.core.events import Cleared, EventData, Removed, Stored, Tier
from kvctl.server.persistence import fold, records, replay, segments
from kvctl.server.persistence.state_log import FLUSH_RECORDS, StateLog
from kvctl.server.state import Fleet
from kvctl.server.worker_info import WorkerInfo

U64 = st.integers(0, 2**64 - 1)
TIERS = st.sampled_from(list(Tier))


@st.composite
def stored(draw: st.DrawFn) -> Stored:
    blocks = draw(st.lists(U64, max_size=8))
    tokens = array("Q", draw(st.lists(U64, min_size=len(blocks), max_size=len(blocks))))
    return Stored(draw(st.none() | U64), blocks, tokens, draw(TIERS))


EVENTS = st.lists(stored() | st.builds(Removed, st.lists(U64, max_size=8).map(lambda h: array("Q", h)), TIERS)
                  | st.just(Cleared()), max_size=4)
NAME = st.text(max_size=8)
RECORD = st.one_of(
    st.tuples(st.just(records.MODEL), NAME, st.integers(1, 1024)),
    st.tuples(st.just(records.WORKER), U64, st.integers(0, 64), NAME, st.none() | NAME, st.none() | NAME, NAME),
    st.tuples(st.just(records.UNREGISTER), U64, st.none() | st.integers(0, 64)),
    st.tuples(st.just(records.BATCH), NAME, U64, st.integers(0, 64), EVENTS),
    st.tuples(st.just(records.DROPPED), st.integers(1, 10**6)),
    st.tuples(st.just(records.SEQS), st.lists(st.tuples(U64, st.integers(0, 64), NAME, U64), max_size=3)))
FRAMES = st.lists(st.lists(RECORD, min_size=1, max_size=5), min_size=1, max_size=5)


def plain(record: Any) -> list[Any]:
    """A record as it reads back, its events as the index takes them, hash arrays as lists."""
    out = list(record)
    if out[0] == records.BATCH:
        out[4] = [_plain_event(records.event_of(e) if isinstance(e, dict) else e) for e in out[4]]
    if out[0] == records.SEQS:
        out[1] = [list(mark) for mark in out[1]]
    return out


def _plain_event(event: EventData) -> tuple[Any, ...]:
    fields = [list(v) if isinstance(v, (list, array)) else v for v in msgspec.structs.astuple(event)]
    return (type(event).__name__, *fields)


def written(path: Path, frames: list[list[Any]]) -> list[int]:
    """`frames` written as the writer thread does; the offset of each."""
    offsets, data = [], bytearray()
    for frame in frames:
        offsets.append(len(data))
        buffer = bytearray()
        records.frame_into(buffer, frame)
        data += buffer
    path.write_bytes(bytes(data))
    return offsets


def read_back(path: Path) -> tuple[list[tuple[int, list[Any]]], records.Scan]:
    scan: list[records.Scan] = []
    frames = [(at, [plain(r) for r in found]) for at, found in records.read(path, scan)]
    return frames, scan[-1]


CASES = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@CASES
@given(frames=FRAMES)
def test_frames_read_back_as_written(tmp_path: Path, frames: list[list[Any]]) -> None:
    path = tmp_path / "segment"
    offsets = written(path, frames)
    got, scan = read_back(path)
    assert got == [(at, [plain(r) for r in frame]) for at, frame in zip(offsets, frames, strict=True)]
    assert scan == records.Scan(path.stat().st_size)


@CASES
@given(frames=FRAMES)
def test_the_first_versions_frame_per_record_still_reads(tmp_path: Path, frames: list[list[Any]]) -> None:
    """The first version framed each record alone: `length, crc32`, then the record's msgpack."""
    flat = [record for frame in frames for record in frame]
    encode = msgspec.msgpack.Encoder(enc_hook=lambda a: a.tobytes()).encode
    data = b""
    for record in flat:
        payload = encode(record)
        data += records.HEAD.pack(len(payload), zlib.crc32(payload)) + payload
    path = tmp_path / "segment"
    path.write_bytes(data)
    got, scan = read_back(path)
    assert [r for _, found in got for r in found] == [plain(r) for r in flat]
    assert scan == records.Scan(len(data))


@CASES
@given(frames=FRAMES, cut=st.floats(0, 1, exclude_max=True))
def test_a_last_frame_cut_short_is_torn_and_the_rest_reads(tmp_path: Path, frames: list[list[Any]],
                                                           cut: float) -> None:
    path = tmp_path / "segment"
    offsets = written(path, frames)
    whole = path.read_bytes()
    last = offsets[-1]
    path.write_bytes(whole[:last + max(1, int(cut * (len(whole) - last)))])
    got, scan = read_back(path)
    assert [at for at, _ in got] == offsets[:-1]
    assert scan == records.Scan(last, torn=True)


@CASES
@given(frames=FRAMES.filter(lambda f: len(f) >= 2), which=st.integers(0), where=st.floats(0, 1, exclude_max=True),
       flip=st.integers(1, 255))
def test_a_damaged_byte_ends_the_read_before_its_frame(tmp_path: Path, frames: list[list[Any]], which: int,
                                                       where: float, flip: int) -> None:
    """Rot anywhere in a frame with more after it: the frames before it read, none from it on, and the read
    does not end clean."""
    path = tmp_path / "segment"
    offsets = written(path, frames)
    data = bytearray(path.read_bytes())
    k = which % (len(frames) - 1)
    start, stop = offsets[k], offsets[k + 1]
    data[start + int(where * (stop - start))] ^= flip
    path.write_bytes(bytes(data))
    got, scan = read_back(path)
    assert [at for at, _ in got] == offsets[:k]
    assert scan.good == start and (scan.torn or scan.corrupt is not None)


def test_a_writer_behind_the_disk_drops_changes_and_the_restore_says_so(tmp_path: Path) -> None:
    """Held writes (the disk slower than ingest): past the backlog whole hand-overs are dropped for a DROPPED
    record, never queued without bound; a restore replays the rest and reports what it misses."""
    fleet = Fleet()
    state_log = StateLog(tmp_path, fleet, restored_from=None, backlog=3 * FLUSH_RECORDS - 1)
    disk = threading.Event()
    state_log._thread.submit(disk.wait)  # the writer thread stuck in a write
    batches = 5 * FLUSH_RECORDS
    for n in range(batches):
        fleet.apply_engine_batch("default", (n % 4, 0), [Stored(None, [n], array("Q", [n]))], 0.0)
    disk.set()
    state_log.close()
    assert state_log.stats.dropped == 3 * FLUSH_RECORDS  # the 3rd, 4th and 5th hand-overs
    assert state_log.stats.lost
    again = Fleet()
    done = replay.restore(again, tmp_path, 0.0)
    assert done.dropped == 3 * FLUSH_RECORDS and done.stopped is None
    lost = done.lost(again)
    assert lost is not None and lost.by_cause == {"dropped": 3 * FLUSH_RECORDS}
    assert lost.reason == (f"restored {2 * FLUSH_RECORDS:,} of {5 * FLUSH_RECORDS:,} blocks: "
                           f"{3 * FLUSH_RECORDS} changes dropped with the log's writer behind the disk")
    assert again.stats().models["default"].blocks == 2 * FLUSH_RECORDS
    assert segments.numbers(tmp_path) == [0]


def test_stream_seqs_are_restored_with_the_batches_they_mark(tmp_path: Path) -> None:
    """Each engine stream's last applied seq goes in the write that holds its batch, so a restore (from the log,
    from an image the compaction child folded, or from a log whose last write was torn) resumes every stream
    right after the batches it restored; a worker removed takes its stream's seq with it."""
    fleet = Fleet()
    state_log = StateLog(tmp_path, fleet, restored_from=None)
    a, b, c = (((n, 0), f"tcp://127.0.0.1:{5556 + n}") for n in (1, 2, 3))
    for (key, endpoint) in (a, b, c):
        fleet.register(WorkerInfo(key[0], key[1], "default", endpoint))
    fleet.apply_engine_batch("default", (2, 0), [Stored(None, [2**63], array("Q", [1]))], 0.0, (b, 41))
    fleet.apply_engine_batch("default", (3, 0), [Stored(None, [2**62], array("Q", [1]))], 0.0, (c, 7))
    fleet.unregister(3)
    for seq in range(3 * FLUSH_RECORDS):  # several writes; block `seq` marked by seq `seq`
        fleet.apply_engine_batch("default", (1, 0), [Stored(None, [seq], array("Q", [seq]))], 0.0, (a, seq))
    state_log.close()
    expected = {a: 3 * FLUSH_RECORDS - 1, b: 41}
    assert fleet.stream_seqs == expected

    from_log = Fleet()
    replay.restore(from_log, tmp_path, 0.0)
    assert from_log.stream_seqs == expected

    torn = tmp_path / "torn"  # the same files, the log's last write cut short by a kill
    shutil.copytree(tmp_path, torn)
    with segments.path(torn, 0).open("r+b") as f:
        f.truncate(f.seek(0, 2) - 5)
    from_torn = Fleet()
    assert replay.restore(from_torn, torn, 0.0).torn == 1
    restored = from_torn.stats().models["default"].workers["1:0"]  # blocks 0..seq, one per batch of stream a
    assert FLUSH_RECORDS < restored < 3 * FLUSH_RECORDS and from_torn.stream_seqs == {a: restored - 1, b: 41}

    assert fold.main([str(tmp_path), "--upto", "1", "--block-size", "16"]) == 0  # segment 0 into the image
    from_image = Fleet()
    done = replay.restore(from_image, tmp_path, 0.0)
    assert (done.log_from, done.records, from_image.stream_seqs) == (1, 0, expected)

