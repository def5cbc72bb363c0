"""The append side of the state log: the fleet's `Journal`, buffered on the loop, written by one thread.

On the loop a change costs a tuple and a list append: it keeps what it was applied from (the objects are frozen,
and the loop builds new ones for every batch). The engine streams' seqs applied go as one SEQS record at the end
of each write, so a restore's seqs always match the batches it restored (a torn write loses both). Encoding,
framing, writing and fsync happen in a single writer thread, a write of many changes at a time, in order, so the
loop never waits on the disk. Writes go out at least every `FLUSH_S` and are fsynced every snapshot interval and
at shutdown; a kill loses at most the last second. Changes handed to the writer and not yet written are bounded
(`backlog`): past it, with the disk slower than ingest, the next ones are dropped, a DROPPED record says so in
their place (a restore before the next image reports it), and the log counts as lost until an image of the whole
index is written, as after a failed write.

Each write begins with a MARK (`records.Mark`): the position of its first change in the state dir's count of
changes, and the index's device blocks once they were applied; after each fsync, and after each write that failed,
the writer records in `state.log.acked` how far the log is acknowledged (`acked`). A restore compares the two
(`gaps`), so a log that lost records says how many.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvctl.core.events import EventData
from kvctl.core.names import StreamId, WorkerKey, selects
from kvctl.core.words import counted
from kvctl.server.persistence import acked, gaps, records, segments, snapshot
from kvctl.server.state import Fleet
from kvctl.server.worker_info import WorkerInfo

log = logging.getLogger("kvctl.serve")

FLUSH_S = 1.0  # the longest a change waits in memory before it is written (not fsynced) to the log
FLUSH_RECORDS = 256  # or until this many changes wait: what a burst holds (its objects) stays under a MiB
BACKLOG = 16384  # changes handed to the writer and not written past which the next drop (`--state-log-backlog`)


@dataclass(slots=True)
class LogStats:
    """What /metrics and /v1/status show of the state log."""

    segment: int  # the segment appended to now
    records: int = 0  # appended since the start (handed to the writer)
    bytes: int = 0  # written since the start, framed
    since_image: int = 0  # bytes a restore would replay after the image
    fsyncs: int = 0
    write_errors: int = 0
    dropped: int = 0  # changes dropped with the writer more than `backlog` behind (the disk slower than ingest)
    lost: bool = False  # a write failed or changes were dropped: the log misses changes until an image is written
    images_after_loss: int = 0
    compactions: int = 0
    compaction_failures: int = 0
    last_compaction_s: float | None = None


class StateLog:
    """Appends the fleet's changes to `state.log.N`; `rotate` starts the next segment for a compaction."""

    def __init__(self, state_dir: Path, fleet: Fleet, *, restored_from: int | None, position: int = 0,
                 backlog: int = BACKLOG) -> None:
        """`restored_from`: the `log_from` of the image the fleet was restored from, its log replayed after it
        (0: no image); None: the fleet did not restore (`--no-restore`, JetStream), so its own image, nearly
        empty, is written first, lest a compaction fold the files of an earlier run in. `position`: where the
        state dir's count of changes goes on from (`replay.Restore.position`)."""
        state_dir.mkdir(parents=True, exist_ok=True)
        numbers = segments.numbers(state_dir)
        self.state_dir = state_dir
        self.stats = LogStats(numbers[-1] + 1 if numbers else 0)
        self.fleet = fleet
        self.position = position  # of the next change handed to the writer, in the state dir's count
        self._acked_file = acked.File(state_dir)
        self._acked: acked.Acked | None = None  # how far the writer got (or failed): recorded at the next fsync
        self._told: acked.Acked | None = None  # what `state.log.acked` holds
        self._acked_failing = False
        self._writing = self.stats.segment  # the segment the writer thread appends to
        if restored_from is None:
            snapshot.write(snapshot.capture(fleet, time.time(), log_from=self.stats.segment, log_pos=position),
                           state_dir)
            self._acked = acked.Acked(position, gaps.blocks_held(self.fleet), self._writing, 0)
            self._tell_acked()  # an earlier run's record would count this run's start as a loss
        else:
            self.stats.since_image = segments.size_from(state_dir, restored_from)
        self._image_at = -self.stats.since_image  # `stats.bytes` where the log after the image starts
        self.backlog = backlog
        self._pending: list[tuple[Any, ...]] = []
        self._seqs: dict[StreamId, int] = {}  # the streams' seqs applied since the last hand-over
        self._handed = 0  # changes handed to the writer (counted on the loop)
        self._written = 0  # of those, written or failed (counted by the writer)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="state-log")
        self._file = _open(segments.path(state_dir, self.stats.segment))
        fleet.journal = self
        for name, state in sorted(fleet.models.items()):  # a log without an image needs them
            self.model(name, state.block_size)

    # ----- the journal: on the loop ---------------------------------------------------------------------

    def model(self, name: str, block_size: int) -> None:
        self._append((records.MODEL, name, block_size))

    def worker(self, info: WorkerInfo) -> None:
        self._append((records.WORKER, info.worker_id, info.dp_rank, info.model, info.endpoint, info.replay_endpoint,
                      info.topic))

    def unregister(self, worker_id: int, dp_rank: int | None) -> None:
        self._append((records.UNREGISTER, worker_id, dp_rank))
        # Their seqs go with them: the SEQS record ending this write must not bring them back after it.
        self._seqs = {s: seq for s, seq in self._seqs.items() if not selects((worker_id, dp_rank), s[0])}

    def batch(self, model: str, worker: WorkerKey, events: Sequence[EventData]) -> None:
        self._append((records.BATCH, model, worker[0], worker[1], events))

    def seq(self, stream: StreamId, seq: int) -> None:
        """Told before its batch is appended (`Fleet.apply_engine_batch`): the write that takes the batch takes
        the seq with it, in the SEQS record that ends it."""
        self._seqs[stream] = seq

    def _append(self, record: tuple[Any, ...]) -> None:
        pending = self._pending
        pending.append(record)
        if len(pending) >= FLUSH_RECORDS:
            self.flush(fsync=False)

    def _hand_over(self) -> list[tuple[Any, ...]]:
        """What waits, for the writer, after its MARK; dropped for a DROPPED record when the writer is `backlog`
        behind. The fleet has applied every change handed (`Fleet` tells its journal after applying)."""
        pending, self._pending = self._pending, []
        if self._seqs:
            pending.append((records.SEQS, [(w, dp, endpoint, seq) for ((w, dp), endpoint), seq in self._seqs.items()]))
            self._seqs = {}
        if not pending:
            return pending
        stats = self.stats
        stats.records += len(pending)
        mark = (records.MARK, self.position, len(pending), gaps.blocks_held(self.fleet))
        self.position += len(pending)
        if self._handed - self._written + len(pending) > self.backlog:
            if not stats.lost:  # once per episode
                log.error("state log: the disk is slower than ingest, %s wait for %s; dropping changes until "
                          "an image of the whole index is written", counted(self._handed - self._written, "change"),
                          self._file.name)
            stats.dropped += len(pending)
            stats.lost = True
            pending = [(records.DROPPED, len(pending))]
        self._handed += len(pending)
        return [mark, *pending]

    def image_from(self, at: int) -> None:
        """The newest image holds the log written before `stats.bytes` was `at` (a cut's)."""
        self._image_at = at
        self.stats.since_image = self.stats.bytes - at

    # ----- the writer thread ------------------------------------------------------------------------------

    def flush(self, *, fsync: bool) -> Future[int]:
        """Hand what is buffered to the writer thread; the future ends once it is written (and fsynced)."""
        return self._thread.submit(self._write, self._hand_over(), fsync)

    def rotate(self) -> tuple[int, Future[int]]:
        """Close the segment appended to (written and fsynced) and start the next: every change before the
        call is in the segments before the returned number once the future is done; it gives `stats.bytes`
        at the cut."""
        pending = self._hand_over()
        self.stats.segment += 1
        return self.stats.segment, self._thread.submit(self._write_and_rotate, pending, self.stats.segment)

    def close(self) -> None:
        """Everything buffered written and fsynced; waits for it (the shutdown's only disk work)."""
        try:
            self.flush(fsync=True).result()
        finally:
            self._thread.shutdown()
            self._file.close()
            self._acked_file.close()

    def _write(self, pending: list[tuple[Any, ...]], fsync: bool) -> int:
        """Write `pending` as one frame; returns `stats.bytes` after it."""
        end = self._file.tell()
        stats = self.stats
        mark = records.mark_of(pending[0]) if pending else None
        try:
            if pending:
                frame = bytearray()
                records.frame_into(frame, pending)
                with memoryview(frame) as data:
                    at = 0
                    while at < len(frame):  # a write that hits a size limit writes part, and only the next fails
                        at += self._file.write(data[at:]) or 0
                stats.bytes += len(frame)
                stats.since_image = stats.bytes - self._image_at
                if mark is not None:
                    self._acked = acked.Acked(mark.end, mark.blocks, self._writing, end + len(frame))
            if fsync:
                os.fsync(self._file.fileno())
                stats.fsyncs += 1
                self._tell_acked()
        except OSError as exc:  # a full disk must not stop the router; what was lost is counted and logged
            stats.write_errors += 1
            stats.lost = True
            log.error("state log %s: %s not written, a restart will not have them: %s",
                      self._file.name, counted(len(pending) - (mark is not None), "change"), exc)
            with contextlib.suppress(OSError):  # no half record for the next write to follow
                os.ftruncate(self._file.fileno(), end)
                self._file.seek(end)
            if mark is not None:  # acknowledged to its senders, yet never in the log: a restart must say so
                self._acked = acked.Acked(mark.end, mark.blocks, self._writing, end, failed=True)
            elif self._acked is not None:  # an fsync that failed: what it should have made durable may be gone
                self._acked = replace(self._acked, failed=True)
            self._tell_acked()
        finally:
            self._written += len(pending) - (mark is not None)
        return stats.bytes

    def _write_and_rotate(self, pending: list[tuple[Any, ...]], number: int) -> int:
        written = self._write(pending, fsync=True)
        self._file.close()
        self._file = _open(segments.path(self.state_dir, number))
        self._writing = number
        return written

    def _tell_acked(self) -> None:
        """Record how far the log is acknowledged (`acked`), unless it is recorded already. It takes no new room,
        so it should not fail where a write did; if it does, the log goes on, said once until it works again."""
        now = self._acked
        if now is None or now == self._told:
            return
        try:
            self._acked_file.write(now)
        except OSError as exc:
            if not self._acked_failing:
                log.error("state log: cannot record how far it is acknowledged in %s (%s): a restart cannot tell "
                          "a log cut short from one that ended", acked.FILENAME, exc)
            self._acked_failing = True
            return
        self._acked_failing = False
        self._told = now


def _open(path: Path) -> BinaryIO:
    """A segment to append to, unbuffered (each write is one framed batch), its name durable."""
    f = path.open("ab", buffering=0)
    snapshot.fsync_dir(path.parent)
    return f


class LogCollector:
    """The state log in /metrics: how much is appended, how often it is compacted, and what failed."""

    def __init__(self, stats: LogStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self.stats
        yield CounterMetricFamily("kvctl_state_log_records", "changes appended to the state log", value=s.records)
        yield CounterMetricFamily("kvctl_state_log_bytes", "bytes appended to the state log", value=s.bytes)
        yield GaugeMetricFamily("kvctl_state_log_since_image_bytes", "state log a restore would replay after "
                                "the image; compacted past --compact-log-bytes and the image's size",
                                value=s.since_image)
        yield CounterMetricFamily("kvctl_state_log_dropped", "changes dropped with more than --state-log-backlog "
                                  "waiting for the disk: a restart misses them until an image of the index is "
                                  "written", value=s.dropped)
        yield CounterMetricFamily("kvctl_state_log_write_errors", "state log writes that failed (a full disk): "
                                  "a restart misses those changes until an image of the index is written",
                                  value=s.write_errors)
        yield GaugeMetricFamily("kvctl_state_log_lost", "1 while the state log misses changes (a write failed "
                                "and no image of the index has been written since)", value=int(s.lost))
        yield CounterMetricFamily("kvctl_state_log_compactions", "images written from the state log by a child",
                                  value=s.compactions)
        yield CounterMetricFamily("kvctl_state_log_compaction_failures", "compaction children that failed",
                                  value=s.compaction_failures)
