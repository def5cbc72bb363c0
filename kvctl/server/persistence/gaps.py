"""What a restore finds missing from the state dir: the changes it acknowledged that the files no longer hold.

Every write of the log begins with a mark, the position of its first change in the state dir's count of changes
(`records.Mark`); an image says how many it holds (`log_pos`); `state.log.acked` says how far the log was
acknowledged (`acked`). Following the positions frame by frame, a restore sees a frame, a segment or the segments
under a damaged image go missing as a jump, and a log cut short at its end as an end before the acknowledged one.

A change is acknowledged once the write that holds it is fsynced (each `--snapshot-interval`, each rotation and at
shutdown), or once the write that should have held it failed: the router took it, and only an image of its index
would keep it. A write lost after the last fsync (a power cut) was never acknowledged, and its loss is no fault.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvctl.core.words import counted
from kvctl.server.persistence import segments
from kvctl.server.persistence.acked import Acked
from kvctl.server.persistence.records import Mark
from kvctl.server.state import Fleet

NAMED = 3
"""Gaps a loss names one by one (its counts take them all): a log that lost every other write stays one line."""


def blocks_held(fleet: Fleet) -> int:
    """The device blocks `fleet`'s index holds, every model: what a mark records and a loss is measured in."""
    return sum(state.router.index.device.blocks for state in fleet.models.values())


@dataclass(frozen=True, slots=True)
class Gap:
    """Changes `first` to `end - 1` of the state dir's count are not in it."""

    first: int
    end: int
    where: str  # which file, where, in words
    cause: str  # a stable label: segment_missing, cut_short, write_failed, damaged_record, image_damaged


@dataclass(frozen=True, slots=True)
class Lost:
    """What a restore restored less than was acknowledged."""

    records: int  # changes missing or dropped
    blocks: int  # device blocks restored
    acknowledged_blocks: int | None  # what the index held at the last change acknowledged; None: not known
    by_cause: dict[str, int]
    gaps: list[Gap]  # the first `NAMED`
    reason: str

    def status(self) -> dict[str, Any]:
        """As `/v1/status` `restore.lost` shows it."""
        return {"reason": self.reason, "records": self.records, "blocks": self.blocks,
                "acknowledged_blocks": self.acknowledged_blocks, "by_cause": self.by_cause,
                "gaps": [{"first": g.first, "end": g.end, "where": g.where, "cause": g.cause} for g in self.gaps]}


@dataclass(slots=True)
class Tracker:
    """Follows a replay's positions: told of each frame before it is applied and of each segment's end."""

    expected: int | None  # where the next frame should begin; None: not known (an image from before the marks)
    log_from: int = 0  # the first segment after the image
    image_damaged: bool = False  # an image was set aside: what precedes the log's first frame was in it
    blocks: int | None = None  # the device blocks the index held at the last change accounted for
    missing: Counter[str] = field(default_factory=Counter)  # changes, by cause
    dropped: int = 0  # changes the log's writer dropped, behind the disk (a DROPPED record)
    named: list[Gap] = field(default_factory=list)
    gaps: int = 0
    _segment: int | None = None  # of the last frame
    _ended: tuple[int, int] | None = None  # the last segment ended: (number, bytes of whole frames)

    def frame(self, segment: int, at: int, mark: Mark | None, changes: int) -> None:
        """A frame of `changes` changes at byte `at` of `segment`, beginning with `mark` (None: written before the
        marks)."""
        if mark is None:
            self.expected = None if self.expected is None else self.expected + changes
            self._segment = segment
            return
        if self.expected is not None and mark.first > self.expected:
            self._gap(self.expected, mark.first, *self._jump_to(segment, at))
        self.expected, self.blocks, self._segment = mark.end, mark.blocks, segment

    def segment_end(self, segment: int, good: int) -> None:
        self._ended = (segment, good)

    def tail(self, acked: Acked | None, present: list[int], size: Callable[[int], int], stopped: str | None) -> None:
        """The log's end against what was acknowledged: `present` the segments there now, `stopped` where a damaged
        record ended the replay (None: it read to the end)."""
        if acked is None or self.expected is None or acked.end <= self.expected:
            return
        self.blocks = acked.blocks
        if stopped is not None:
            self._gap(self.expected, acked.end, f"after the damaged record in {stopped}", "damaged_record")
        elif acked.failed:
            self._gap(self.expected, acked.end, f"writes to {segments.name(acked.segment)} after byte "
                      f"{acked.offset:,} that failed (a full disk?), and no image of the index since", "write_failed")
        elif acked.segment not in present:
            last = self._ended[0] if self._ended is not None else self.log_from - 1
            self._gap(self.expected, acked.end, _missing(last + 1, acked.segment + 1), "segment_missing")
        else:
            name, held = segments.name(acked.segment), size(acked.segment)
            self._gap(self.expected, acked.end, f"{name} cut short at byte {held:,} (it held {acked.offset:,})"
                      if held < acked.offset else f"the log's end ({name} held them up to byte {acked.offset:,})",
                      "cut_short")

    def resume_at(self, acked: Acked | None) -> int:
        """Where the next run's positions go on from: past every change acknowledged, found or not, so that a
        loss stays visible in the files until an image of the index is written."""
        return max(self.expected or 0, acked.end if acked is not None else 0)

    def lost(self, blocks: int) -> Lost | None:
        """The loss, with `blocks` restored; None when every acknowledged change is there."""
        causes = dict(self.missing)
        if self.dropped:
            causes["dropped"] = self.dropped
        total = sum(causes.values())
        if not total:
            return None
        of = f" of {self.blocks:,}" if self.blocks is not None and self.blocks != blocks else ""
        what = []
        if self.gaps:
            named = [f"{g.where} (records {g.first:,} to {g.end - 1:,})" for g in self.named]
            if self.gaps > len(self.named):
                named.append(f"{counted(self.gaps - len(self.named), 'more gap')}")
            what.append(f"{counted(total - self.dropped, 'acknowledged state log record')} missing: "
                        f"{'; '.join(named)}")
        if self.dropped:
            what.append(f"{counted(self.dropped, 'change')} dropped with the log's writer behind the disk")
        noun = "block" if (self.blocks if of else blocks) == 1 else "blocks"
        return Lost(total, blocks, self.blocks, causes, list(self.named),
                    f"restored {blocks:,}{of} {noun}: {'; '.join(what)}")

    def _jump_to(self, segment: int, at: int) -> tuple[str, str]:
        """Where the changes went that should come before byte `at` of `segment`, and why: the cause label."""
        if self._segment == segment:
            return f"{segments.name(segment)} at byte {at:,}, a write that failed", "write_failed"
        if self._ended is None and self.image_damaged:  # segments a compaction deleted, held by those images
            return f"before {segments.name(segment)}, in the images that were damaged", "image_damaged"
        last, good = self._ended if self._ended is not None else (self.log_from - 1, None)
        if segment > last + 1:
            return _missing(last + 1, segment), "segment_missing"
        if good is None:  # the image's own first segment: what should come before it is not in the image
            return f"before {segments.name(segment)}", "segment_missing"
        return f"{segments.name(last)} cut short at byte {good:,}", "cut_short"

    def _gap(self, first: int, end: int, where: str, cause: str) -> None:
        self.missing[cause] += end - first
        self.gaps += 1
        if len(self.named) < NAMED:
            self.named.append(Gap(first, end, where, cause))


def _missing(first: int, end: int) -> str:
    """Segments `first` to `end - 1`, gone."""
    if end - first == 1:
        return f"{segments.name(first)} missing"
    return f"{segments.name(first)} to {segments.name(end - 1)} missing"
