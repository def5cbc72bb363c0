"""An engine stream's lost gaps in the log, without a flood: an engine that drops a batch in ten used to
write a WARNING per gap, thousands a minute, burying every other line.

The first loss of a stream is logged at once (with its seqs and why it could not be replayed); later ones
are summed up, at most one line per stream every `GAP_SUMMARY_S`; the totals are logged when the stream
stops (a removed worker, or the router shutting down). /v1/status and /metrics keep the exact counts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvctl.core.words import counted

log = logging.getLogger(__name__)

GAP_SUMMARY_S = 10.0
"""At most one summary line per stream this often: a loss still shows within seconds, while 100 streams
losing without end write 10 lines a second at most."""


class GapLog:
    """The lost gaps of one stream (`name`, as its log lines start), logged as the module says; `clock` is
    monotonic seconds."""

    def __init__(self, name: str, clock: Callable[[], float], interval_s: float = GAP_SUMMARY_S) -> None:
        self.name = name
        self.interval_s = interval_s
        self._clock = clock
        self.gaps = 0  # lost gaps since the stream started
        self.batches = 0  # the batches they held
        self._logged_at: float | None = None  # when the last line was written
        self._pending_gaps = 0  # lost since that line
        self._pending_batches = 0

    def lost(self, first: int, last: int, why: str) -> None:
        """Seqs `first..last` could not be had, because of `why`."""
        self.gaps += 1
        self.batches += last - first + 1
        if self._logged_at is None:
            log.warning("%s: seq gap %d..%d lost (%s); further losses are summed up every %g s", self.name,
                        first, last, why, self.interval_s)
            self._logged_at = self._clock()
            return
        self._pending_gaps += 1
        self._pending_batches += last - first + 1
        self.flush()

    def flush(self) -> None:
        """Write the summary of the losses since the last line, once `interval_s` has passed since it."""
        now = self._clock()
        if self._pending_gaps and self._logged_at is not None and now - self._logged_at >= self.interval_s:
            log.warning("%s: %s lost in the last %.0f s, %s", self.name,
                        counted(self._pending_gaps, "more gap", "more gaps"),
                        now - self._logged_at, counted(self._pending_batches, "batch", "batches"))
            self._logged_at = now
            self._pending_gaps = self._pending_batches = 0

    def close(self) -> None:
        """The stream stops: its totals, when it lost anything."""
        if self.gaps:
            log.warning("%s: stopped; %s lost in all, %s", self.name, counted(self.gaps, "gap"),
                        counted(self.batches, "batch", "batches"))
        self._pending_gaps = self._pending_batches = 0
