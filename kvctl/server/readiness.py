"""Whether the router's index is whole: `/readyz`, the gate on the routes a partial index would answer wrong.

A restart binds its port at once and restores the index on its event loop, a slice at a time (issue 27), so
liveness (`/healthz`) and the restore's progress answer from the first moment. Until the index is whole a
route would pick workers from part of it and a dump would miss blocks (`tree diff` then reports false gaps),
so those are refused with 503 and `Retry-After`, saying how far the restore is; status, metrics, the probes
and the worker list answer as ever.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from kvctl import http_api as api
from kvctl.server.health import Health
from kvctl.server.persistence.snapshot import Progress

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
RETRY_AFTER_S = 1
"""What a refused client is told to wait (`Retry-After`): a restore is a few seconds long, and reports
its progress every slice."""


class Readiness:
    """The restore's progress, set by the daemon's restore task; ready from the start when nothing is restored."""

    def __init__(self, *, restoring: bool, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.started = clock()
        self.progress: Progress | None = Progress("starting", 0, 0, "bytes") if restoring else None
        self.restore_s: float | None = None if restoring else 0.0
        self.restored: dict[str, Any] | None = None  # what /v1/status shows of the restore, once done
        self.ready = not restoring  # an attribute, not a property: the route fast path reads it on every route

    def step(self, progress: Progress) -> None:
        self.progress = progress

    def finish(self, restored: dict[str, Any] | None) -> None:
        self.restored = restored
        self.progress = None
        self.ready = True
        self.restore_s = round(self.clock() - self.started, 3)

    def answer(self, health: Health | None = None) -> api.Readiness:
        """The restore's progress; once restored, what `health`'s faults make of readiness."""
        if self.progress is None:
            faults = list(health.faults.values()) if health is not None else []
            if not faults:
                return api.Readiness("ready", restore_s=self.restore_s)
            status = "degraded" if any(f.blocks for f in faults) else "partial"
            return api.Readiness(status, restore_s=self.restore_s,
                                 faults=[f"{f.part}: {f.reason}" for f in sorted(faults, key=lambda f: f.part)])
        p = self.progress
        return api.Readiness("restoring", phase=p.phase, done=p.done, total=p.total, unit=p.unit,
                             percent=_percent(p), elapsed_s=round(self.clock() - self.started, 3))

    def refuses(self, method: str, path: str) -> bool:
        """Whether a request waits for the whole index: routes, event loads, dumps and every other change."""
        return not self.ready and (method not in SAFE_METHODS or path.startswith("/v1/tree"))

    def refusal(self) -> api.Error:
        return api.Error(f"{self.line()}; retry in a moment (GET /readyz says when it is whole)",
                         restoring=self.answer())

    def warned(self, send: Any) -> Any:
        """An ASGI send adding a `Warning` header (RFC 9111's form, which Kubernetes' API server uses too) to an
        answer given while restoring: clients print it, so a worker list or a status read mid-restore is not
        taken for the whole index. Quoted text: the line has no quotes or backslashes to escape."""
        warning = (f'299 kvctl "{self.line()}: answers show part of the index, and routes, dumps and changes are '
                   f'refused (503) until GET /readyz answers 200"').encode()

        async def warned(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"warning", warning)]}
            await send(message)

        return warned

    def line(self) -> str:
        """One line for a refusal and systemd's STATUS=: what is restored, how far, for how long."""
        p = self.progress
        if p is None:
            return "ready"
        return (f"restoring the index: {p.phase}, {_percent(p):g}% ({p.done:,}/{p.total:,} {p.unit}), "
                f"{self.clock() - self.started:.1f} s so far")


class ReadinessCollector:
    """`kvctl_ready` in /metrics: what `/readyz` says, for the alert on a restore that does not end."""

    def __init__(self, readiness: Readiness) -> None:
        self.readiness = readiness

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("kvctl_ready", "1 once the index is whole; 0 while a restart restores it "
                                "(GET /readyz)", value=1 if self.readiness.ready else 0)


def _percent(p: Progress) -> float:
    return math.floor(1000 * p.done / p.total) / 10 if p.total else 0.0
