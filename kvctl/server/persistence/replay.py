"""Restore = the newest sound image, then the log segments after it replayed in order.

A frame cut short at a segment's end (a kill mid-write) is dropped; a damaged frame with more after it
stops the replay there, with the problem reported, so the state is what it was before that record, never
a crash. Replay is a generator of slices, so a caller can yield to its loop between them. On the way it follows
the frames' marks (`gaps`), and says what it restored less than the state dir acknowledged (`Restore.lost`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from kvctl.core.names import SeqMark
from kvctl.server.ingest.endpoint import check_endpoint
from kvctl.server.persistence import acked, gaps, records, segments, snapshot
from kvctl.server.state import Fleet, UnknownWorker
from kvctl.server.worker_info import WorkerInfo


@dataclass(slots=True)
class Restore:
    image: snapshot.Restored | None = None
    log_from: int = 0  # the loaded image's first segment not in it (0: no image)
    records: int = 0  # log records replayed
    segments: int = 0
    torn: int = 0  # segments whose last record was cut short, and dropped
    stopped: str | None = None  # where a damaged record stopped the replay
    written_at: float | None = None  # when the newest segment replayed was last written to (epoch seconds)
    problems: list[str] = field(default_factory=list)  # images that were damaged, and set aside
    unknown_end: str | None = None  # why the log's acknowledged end is not known (`acked`): its file is damaged
    marks: gaps.Tracker = field(default_factory=lambda: gaps.Tracker(0))  # followed frame by frame: what is missing
    position: int = 0  # where the state dir's count of changes goes on from (`StateLog`'s `position`)

    @property
    def dropped(self) -> int:
        """Changes the log says it dropped (its writer behind the disk): the index misses them."""
        return self.marks.dropped

    def lost(self, fleet: Fleet) -> gaps.Lost | None:
        """What this restore into `fleet` restored less than the state dir acknowledged; None: nothing."""
        return self.marks.lost(gaps.blocks_held(fleet))


def restore(fleet: Fleet, state_dir: Path, now: float, *, upto: int | None = None, repair: bool = False) -> Restore:
    """The whole restore in one go (see `slices`)."""
    return snapshot.run_to_end(slices(fleet, state_dir, now, upto=upto, repair=repair))


def slices(fleet: Fleet, state_dir: Path, now: float, *, upto: int | None = None,
           repair: bool = False) -> Generator[snapshot.Progress, None, Restore]:
    """Load the image into `fleet` (empty, with no journal attached), then replay the segments from its
    `log_from` up to `upto` (excluded; None: all), yielding how far it is after each line or event of the
    image and each frame of the log. `repair` (the router's own start): cut a torn tail off its segment and
    set a damaged record's segment (copied) and every later one aside, so that the files say what was
    restored."""
    image, problems = yield from snapshot.restore_in_slices(fleet, state_dir, now)
    done = Restore(image, image.log_from if image is not None else 0, problems=problems)
    done.marks = gaps.Tracker(image.log_pos if image is not None else 0, done.log_from, image_damaged=bool(problems))
    numbers = [n for n in segments.numbers(state_dir) if n >= done.log_from and (upto is None or n < upto)]
    total = sum(_size(segments.path(state_dir, n)) for n in numbers)
    before = 0  # bytes of the segments replayed before this one
    for number in numbers:
        path = segments.path(state_dir, number)
        scans: list[records.Scan] = []
        for at, found in records.read(path, scans):
            try:  # a frame is checked whole before any of it is applied
                mark = records.mark_of(found[0])
                changes = [_change(fleet, record, now) for record in (found[1:] if mark is not None else found)]
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                scans.append(records.Scan(at, corrupt=f"bad record at byte {at}: {exc}"))
                break
            done.marks.frame(number, at, mark, len(changes))
            for change in changes:
                if isinstance(change, int):
                    done.marks.dropped += change
                else:
                    change()
                done.records += 1
            yield snapshot.Progress("replaying the state log", before + at, total, "bytes")
        before += _size(path)
        done.segments += 1
        done.written_at = path.stat().st_mtime
        scan = scans[-1]
        done.marks.segment_end(number, scan.good)
        if scan.torn:
            done.torn += 1
            if repair:
                os.truncate(path, scan.good)
        if scan.corrupt is not None:
            done.stopped = f"{path.name}: {scan.corrupt}"
            if repair:
                _set_aside(state_dir, number, scan.good)
            break
    if upto is None:  # a compaction folds part of the log: its end is no loss
        told, done.unknown_end = acked.read(state_dir)
        done.marks.tail(told, segments.numbers(state_dir), lambda n: _size(segments.path(state_dir, n)), done.stopped)
        done.position = done.marks.resume_at(told)
    else:
        done.position = done.marks.resume_at(None)
    return done


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # deleted since it was listed: a compaction folded it into the image
        return 0


def _set_aside(state_dir: Path, number: int, good: int) -> None:
    """Keep a damaged segment (copied) and those after it for a post-mortem, out of the next start's way;
    the damaged one keeps the records before the damage under its own name, so later restores replay them."""
    for n in segments.numbers(state_dir):
        path = segments.path(state_dir, n)
        aside = path.with_name(path.name + ".damaged")
        if n == number:
            shutil.copyfile(path, aside)
            os.truncate(path, good)
        elif n > number:
            os.replace(path, aside)


def _change(fleet: Fleet, record: list[Any], now: float) -> Callable[[], object] | int:
    """A record checked and made ready to apply; a DROPPED record is the count of changes it stands for."""
    kind = record[0]
    if kind == records.MARK:
        raise ValueError("a frame's mark inside it")
    if kind == records.MODEL:
        _, name, block_size = record
        return partial(fleet.add_model, str(name), block_size=int(block_size))
    if kind == records.WORKER:
        _, worker_id, dp_rank, model, endpoint, replay_endpoint, topic = record
        for address in (endpoint, replay_endpoint):
            if address is not None:
                check_endpoint(address)
        return partial(fleet.register, WorkerInfo(int(worker_id), int(dp_rank), str(model), endpoint,
                                                  replay_endpoint, str(topic)))
    if kind == records.UNREGISTER:
        _, worker_id, dp_rank = record
        return partial(_unregister, fleet, int(worker_id), dp_rank)
    if kind == records.DROPPED:
        _, count = record
        return int(count)
    if kind == records.SEQS:
        _, marks = record
        return partial(_resume_at, fleet, [records.seq_mark(m) for m in marks])
    _, model, worker_id, dp_rank, events = record
    return partial(fleet.apply_engine_batch, str(model), (int(worker_id), int(dp_rank)),
                   [records.event_of(e) for e in events], now)


def _resume_at(fleet: Fleet, marks: list[SeqMark]) -> None:
    for stream, seq in marks:
        fleet.applied_seq(stream, seq)


def _unregister(fleet: Fleet, worker_id: int, dp_rank: int | None) -> None:
    with contextlib.suppress(UnknownWorker):  # removed before, in a record already replayed
        fleet.unregister(worker_id, dp_rank)
