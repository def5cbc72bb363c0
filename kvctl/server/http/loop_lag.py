"""What the loop probe (`daemon.watch_loop`) saw: each wake-up's lateness, and the time the loop was held.

The histogram (`kvctl_event_loop_lag_seconds`) gets one sample per probe, so a 0.5 s stall is one late
wake-up among thousands of 10 ms probes and no quantile moves. What routes and events waited is the time
spent late: `kvctl_event_loop_blocked_seconds_total` sums it (beyond a 10 ms tolerance), and its rate is the
share of wall time the loop was held (the alert's figure); the last minute of it is in `/v1/status`
(`loop`), which `kvctl doctor` reads.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

LOOP_LAG_BUCKETS = (0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
"""From 2.5 ms: below that is the loop's own timer granularity (libuv's clock is in milliseconds)."""

TOLERANCE_S = 0.010
"""Lateness up to this is not blocked time: the router promises that nothing holds its loop longer (a route
waits under 10 ms), and below it are the timer's granularity and a busy host's scheduling (5-12 ms late
probes on a loaded 2-core machine). A probe woken later counts what it waited beyond it."""

WINDOW_S = 60.0
"""How far back `/v1/status` sums the stalls: a minute holds one periodic snapshot at the default interval."""


class LoopLag(Collector):
    """The probe's readings: a histogram of lateness per probe, the seconds held in stalls (a counter at
    scrape time), and the stalls of the last `WINDOW_S`, for a check that reads the router once."""

    def __init__(self, registry: CollectorRegistry, clock: Callable[[], float] = time.monotonic) -> None:
        self.histogram = Histogram(
            "kvctl_event_loop_lag_seconds", "how late the event loop woke a probe due every 10 ms: what any "
            "request or event waited, then, behind whatever held the loop", buckets=LOOP_LAG_BUCKETS,
            registry=registry)
        registry.register(self)
        self.clock = clock
        self.blocked_s = 0.0
        self.stalls = 0
        self._recent: deque[tuple[float, float]] = deque()  # (woke at, seconds blocked) of the window's stalls

    def observe(self, late_s: float) -> None:
        self.histogram.observe(late_s)
        blocked = late_s - TOLERANCE_S
        if blocked <= 0:
            return
        now = self.clock()
        self.blocked_s += blocked
        self.stalls += 1
        self._recent.append((now, blocked))
        self._forget(now)

    def _forget(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - WINDOW_S:
            self._recent.popleft()

    def status(self) -> dict[str, Any]:
        """`/v1/status`' `loop`: totals since start, and the last minute's share held, stalls and longest.

        Always a share of the whole minute, even in a router's first: a start's few slow probes over a few
        seconds would read as a loop held most of the time."""
        self._forget(self.clock())
        held = [blocked for _, blocked in self._recent]
        return {"tolerance_s": TOLERANCE_S, "blocked_s": round(self.blocked_s, 3), "stalls": self.stalls,
                "window_s": WINDOW_S, "window_blocked_share": round(min(1.0, sum(held) / WINDOW_S), 4),
                "window_stalls": len(held), "window_longest_s": round(max(held, default=0.0), 3)}

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "kvctl_event_loop_blocked_seconds", "seconds the event loop was held past 10 ms: each probe's "
            "lateness beyond 10 ms, summed. Its rate is the share of wall time routes and events waited behind a "
            "stall", value=self.blocked_s)
