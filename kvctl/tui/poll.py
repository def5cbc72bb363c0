"""What one poll of a router brings back, kept raw so that a recording replays into the very same frames.

Rates are not polled: the router exposes cumulative counters (events applied, routes decided, the predicted
hit rate's histogram sum and count) on `/metrics`, and the frame divides their increase between two polls
by the time between them. A recording keeps the counters and the poll times, never computed rates.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvctl.core.tiers import Sample

EVENTS = "events"
ROUTES = "routes"
PREDICTED_SUM = "predicted_sum"
PREDICTED_COUNT = "predicted_count"

# Sample names on the router's /metrics (prometheus_client adds `_total` to counters) -> the counter they add to.
_COUNTER_SAMPLES = {
    "kvctl_kv_events_applied_total": EVENTS,
    "kvctl_route_duration_seconds_count": ROUTES,
    "kvctl_route_predicted_hit_rate_sum": PREDICTED_SUM,
    "kvctl_route_predicted_hit_rate_count": PREDICTED_COUNT,
}


def router_counters(samples: Iterable[Sample]) -> dict[str, float]:
    """The router's cumulative counters, summed over models and outcomes (every event counts, applied or
    rejected: events/s says whether events arrive at all)."""
    totals = dict.fromkeys(_COUNTER_SAMPLES.values(), 0.0)
    for sample in samples:
        counter = _COUNTER_SAMPLES.get(sample.name)
        if counter is not None:
            totals[counter] += sample.value
    return totals


@dataclass(frozen=True, slots=True)
class TierRate:
    """One instance's hit rate of one tier, as the tiers panel shows it."""

    instance: str
    tier: str
    hit_rate: float
    family: str


@dataclass(frozen=True, slots=True)
class Poll:
    """One poll: `GET /v1/status`, `GET /v1/workers`, the router's counters, its decision audit (`GET /v1/audit`)
    and the tiers when asked for.

    `at` is the source's clock in seconds (monotonic live; synthetic in fakes), used only for differences.
    `audit` is the audit's answer as the router sent it; None with `audit_note` saying why (a router without the
    audit), or with neither where it was not asked (a recording made before top showed it).
    """

    at: float
    status: dict[str, Any]
    workers: list[dict[str, Any]]
    counters: dict[str, float] = field(default_factory=dict)
    tiers: tuple[TierRate, ...] | None = None  # None: no tiers source was given
    tiers_error: str | None = None
    tiers_note: str | None = None  # the instances that export no tier counters, said once
    audit: dict[str, Any] | None = None
    audit_note: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Poll:
        raw = json.loads(line)
        tiers = raw.get("tiers")
        return cls(at=raw["at"], status=raw["status"], workers=raw["workers"], counters=raw.get("counters") or {},
                   tiers=None if tiers is None else tuple(TierRate(**t) for t in tiers),
                   tiers_error=raw.get("tiers_error"), tiers_note=raw.get("tiers_note"), audit=raw.get("audit"),
                   audit_note=raw.get("audit_note"))
