"""A source with no router behind it, for Pilot tests, snapshots and `benchmarks/top_bench.py`.

Everything it shows is a function of the poll number and a seed: ages, uptime and rates repeat exactly,
so a snapshot never shows a clock.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from kvctl.errors import Unreachable
from kvctl.http_api import Cleared, ClearedModel
from kvctl.tui.poll import EVENTS, PREDICTED_COUNT, PREDICTED_SUM, ROUTES, Poll, TierRate
from kvctl.tui.prefixes import Prefix

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


def fleet(workers: int = 8, *, seed: int = 0, interval: float = 1.0,
          tiers: bool = False) -> Callable[[int], Poll]:
    """A fleet of `workers` ranks (two models, two dp ranks a worker) whose load moves from poll to poll.

    Every 7th rank is busy, every 11th has a gapped stream, every 13th has been silent for a minute.
    """

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
        return Poll(at=n * interval, status=status, workers=rows, counters=counters, tiers=rates)

    return poll


PREFIXES = (
    Prefix(4, 4, ("100:0", "100:1", "101:0", "101:1"), 0, (
        Prefix(8, 12, ("100:0", "101:1"), 1, (), 0),
        Prefix(3, 7, ("101:0",), 0, (), 0),
    ), 0),
    Prefix(16, 16, ("102:0", "103:1"), 0, (), 2),
)
"""A small fixed tree for the tree view's tests and snapshot."""
