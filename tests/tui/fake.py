"""A source with no router behind it, for Pilot tests, snapshots and `benchmarks/top_bench.py`.

Everything it shows is a function of the poll number and a seed: ages, uptime and rates repeat exactly,
so a snapshot never shows a clock.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from kvctl.errors import Unreachable
from kvctl.http_api import Audit, AuditWorker, Cleared, ClearedModel
from kvctl.tui.poll import EVENTS, PREDICTED_COUNT, PREDICTED_SUM, ROUTES, Poll, TierRate
from kvctl.tui.prefixes import Prefix
from kvctl.tui.sources import AUDIT_WINDOW_S, NO_AUDIT

MODELS = ("llama", "qwen")


class FakeSource:
    """`polls(n)` is the n-th poll. Set `down` to make polls fail as an unreachable router does; resets are
    kept in `resets` instead of being sent anywhere."""

    def __init__(self, polls: Callable[[int], Poll], *, label: str = "http://fake-router:7433",
                 prefixes: tuple[Prefix, ...] = ()) -> None:
        self.label = label
        self._polls = polls
        self._prefixes = prefixes
        self.polled = 0
        self.down = False
        self.resets: list[tuple[str, int, int]] = []

    async def poll(self) -> Poll:
        if self.down:
            raise Unreachable(f"cannot reach the router at {self.label}: connection refused")
        poll = self._polls(self.polled)
        self.polled += 1
        return poll

    async def reset(self, model: str, worker_id: int, dp_rank: int) -> Cleared:
        self.resets.append((model, worker_id, dp_rank))
        return Cleared([ClearedModel(model, [f"{worker_id}:{dp_rank}"], 0)])

    async def prefixes(self, model: str) -> tuple[Prefix, ...]:
        return self._prefixes

    async def aclose(self) -> None:
        return None


AuditState = Literal["figures", "empty", "missing", "unpolled"]

LOOKED_AT = ("no decision heard in the last 300 s (12 since start): the audit hears kvctl's own /v1/route picks and a "
             "Dynamo frontend's from its replica sync (start the frontend with --router-replica-sync and this router "
             "on the same event plane)")
"""What kvctl serve says an empty window looked at (kvctl/server/http/audit_routes.py)."""


def audit_answer(state: AuditState) -> tuple[dict[str, Any] | None, str | None]:
    """A poll's (audit, audit_note): `GET /v1/audit` over 5 minutes as a router answers it: 50 decisions, 46 with
    cache to find, 38 of them to a worker holding the most (83 %), 8 for load balance; or an empty window; or a
    router without the audit (404); or none asked for (a recording from before the audit line)."""
    if state == "missing":
        return None, NO_AUDIT
    if state == "unpolled":
        return None, None
    empty = state == "empty"
    answer = Audit(
        window_s=AUDIT_WINDOW_S, model=None, heard=12 if empty else 62, kept=12 if empty else 62, capacity=10_000,
        decisions=0 if empty else 50,
        outcomes={"optimal": 0 if empty else 42, "suboptimal": 0 if empty else 8, "unknown": 0},
        cached_decisions=0 if empty else 46, optimal_share=None if empty else 38 / 46,
        avoidable_prefill_tokens=0 if empty else 1536, cacheable_prefill_tokens=0 if empty else 21_504,
        avoidable_share=None if empty else 1536 / 21_504,
        agreement={"agree": 0 if empty else 34, "tie": 0 if empty else 16, "disagree": 0, "unknown": 0},
        agreement_share=None if empty else 1.0, reasons={} if empty else {"load_balance": 8},
        routers={} if empty else {"kvctl": 50},
        workers=[] if empty else [AuditWorker(100, 0, 50, 42, 8, 0, 1536)],
        looked_at=LOOKED_AT if empty else "50 decisions heard in the last 300 s")
    return msgspec.to_builtins(answer), None


def fleet(workers: int = 8, *, seed: int = 0, interval: float = 1.0, tiers: bool = False,
          audit: AuditState = "figures") -> Callable[[int], Poll]:
    """A fleet of `workers` ranks (two models, two dp ranks a worker) whose load moves from poll to poll.

    Every 7th rank is busy, every 11th has a gapped stream, every 13th has been silent for a minute; the router's
    decision audit is `audit_answer(audit)`.
    """
    audited, audit_note = audit_answer(audit)

    def poll(n: int) -> Poll:
        rng = random.Random(seed * 1_000_003 + n)
        rows: list[dict[str, Any]] = []
        streams: list[dict[str, Any]] = []
        for i in range(workers):
            key = {"worker_id": 100 + i // 2, "dp_rank": i % 2}
            silent = i % 13 == 5
            rows.append({**key, "model": MODELS[(i // 2) % len(MODELS)], "endpoint": f"tcp://engine-{i // 2}:5557",
                         "blocks": 500 + 37 * i + rng.randrange(50), "active_decode_blocks": rng.randrange(200),
                         "active_prefill_tokens": rng.randrange(4096), "busy": i % 7 == 3,
                         "last_event_age_s": 60.0 if silent else round(0.1 * (i % 10), 1),
                         "routes": (n + 1) * (10 + i % 5)})
            gapped = i % 11 == 4
            streams.append({"worker": key, "endpoint": rows[-1]["endpoint"], "messages": 1000 * (n + 1),
                            "gaps": 2 if gapped else 0, "lost_batches": 1 if gapped else 0, "replays_failed": 0,
                            "restarts": 0, "replaying": False, "gapped": gapped,
                            "decode_errors": {"unknown_event": 1} if i % 17 == 2 else {}})
        models = {m: {"block_size": 16, "blocks": sum(r["blocks"] for r in rows if r["model"] == m),
                      "nodes": 40 * workers + n, "workers": {}} for m in MODELS}
        status = {"version": "fake", "uptime_s": 3600.0 + n * interval, "rss_bytes": 734_003_200, "models": models,
                  "streams": streams, "queues": [{"model": m, "dropped_batches": 0} for m in MODELS],
                  "event_plane": None}
        counters = {EVENTS: 1200.0 * n + 40 * (n % 3) * n, ROUTES: 90.0 * n + 5 * (n % 4) * n,
                    PREDICTED_SUM: 0.6 * 90 * n + 0.02 * n * (n % 5), PREDICTED_COUNT: 90.0 * n}
        rates = (TierRate("engine-0:8000", "host", 0.42, "vllm:prompt_tokens_cached_by_source"),
                 TierRate("engine-1:8000", "host", 0.38, "vllm:prompt_tokens_cached_by_source"),
                 TierRate("engine-0:8000", "disk", 0.07, "kvbm_disk_cache_hit_rate")) if tiers else None
        return Poll(at=n * interval, status=status, workers=rows, counters=counters, tiers=rates, audit=audited,
                    audit_note=audit_note)

    return poll


PREFIXES = (
    Prefix(4, 4, ("100:0", "100:1", "101:0", "101:1"), 0, (
        Prefix(8, 12, ("100:0", "101:1"), 1, (), 0),
        Prefix(3, 7, ("101:0",), 0, (), 0),
    ), 0),
    Prefix(16, 16, ("102:0", "103:1"), 0, (), 2),
)
"""A small fixed tree for the tree view's tests and snapshot."""
