"""What the router refused or lost, and which of its parts are down: one ledger that every entry point writes to
and `/readyz`, `/v1/status`, `/metrics` and doctor read, so that no loss and no stopped part is silent (issue 36).

A *loss* is input refused or dropped at an entry point, counted by surface (where it came in) and cause (the limit
or fault that refused it). A *fault* is a part that is down or incomplete now: it is raised with a reason and the fix,
logged at ERROR once (and again only when its reason changes), and cleared, with an INFO line, when the part works
again. A fault that `blocks` makes `/readyz` answer 503 (the router cannot see a model at all); one that does not
makes it answer 200 "partial" (the index is missing something it acknowledged, but what it has is right).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvctl import http_api as api

log = logging.getLogger("kvctl.serve")


@dataclass
class Fault:
    part: str  # stable, for scripts and the metric's label: "plane.discovery", "state_dir", "recovery", ...
    reason: str  # what is wrong, with the numbers: "restored 80,000 of 96,000 blocks: segment 3 is missing"
    fix: str  # the next step, as doctor shows it
    blocks: bool  # True: /readyz answers 503 while it holds
    since: float


@dataclass
class Loss:
    count: int
    last_at: float
    detail: str  # the last occurrence, in words: which peer, which file, how large
    fix: str  # what to change if these losses matter: a flag, the sender, the runbook's section


class Health:
    """The ledger. Methods are cheap and never raise: they are called from hot loops and error paths alike."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.faults: dict[str, Fault] = {}
        self.losses: dict[tuple[str, str], Loss] = {}

    def lose(self, surface: str, cause: str, n: int = 1, detail: str = "", fix: str = "") -> None:
        """Count `n` inputs refused or dropped at `surface` (where they came in: "http", "recovery", "discovery",
        "zmq", "replica_sync", "nats", ...) for `cause` (a stable label: "too_large", "slow_consumer", ...).
        Logging, if any, is the caller's: a flood must not become a flood of log lines."""
        loss = self.losses.get((surface, cause))
        if loss is None:
            self.losses[(surface, cause)] = Loss(n, self.clock(), detail, fix)
        else:
            loss.count += n
            loss.last_at = self.clock()
            loss.detail = detail or loss.detail
            loss.fix = fix or loss.fix

    def fail(self, part: str, reason: str, fix: str, *, blocks: bool = False) -> None:
        """Mark `part` down (or the index partial) for `reason`; logged at ERROR when new or when the reason changes."""
        fault = self.faults.get(part)
        if fault is not None and fault.reason == reason:
            return
        self.faults[part] = Fault(part, reason, fix, blocks, fault.since if fault is not None else self.clock())
        log.error("%s: %s; %s", part, reason, fix)

    def recover(self, part: str) -> None:
        fault = self.faults.pop(part, None)
        if fault is not None:
            log.info("%s: working again after %.1f s (was: %s)", part, self.clock() - fault.since, fault.reason)

    def blocking(self) -> list[Fault]:
        return [f for f in self.faults.values() if f.blocks]

    def answer(self) -> api.HealthLedger:
        now = self.clock()
        return api.HealthLedger(
            faults=[api.PartFault(f.part, f.reason, f.fix, f.blocks, round(now - f.since, 3))
                    for f in sorted(self.faults.values(), key=lambda f: f.part)],
            losses=[api.InputLoss(surface, cause, loss.count, round(now - loss.last_at, 3), loss.detail, loss.fix)
                    for (surface, cause), loss in sorted(self.losses.items())])
