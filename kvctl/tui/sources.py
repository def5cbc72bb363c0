"""Where `kvctl top` gets its polls: a live router, a recording of one, or a fake (the tests' `tests/tui/fake.py`).

The app is handed a `Source` and never builds a client itself (dolphie's live/replay split). A live
source speaks to the router only through `kvctl.client`: the async client for the JSON API, and the
blocking `/metrics` scraper and dump reader (on a thread) for what the JSON API does not carry.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, Protocol

import msgspec

from kvctl.client import AsyncRouterClient, calls
from kvctl.client.tier_sources import Auth, Scraper, metrics_url, prometheus_windows
from kvctl.core.doctor.frontend_queue import queue_note
from kvctl.core.tiers import CHECK_TIERS, Sample, Window, hit_rates, increases, report
from kvctl.errors import KvctlError, NotFound, UsageError
from kvctl.http_api import Cleared
from kvctl.tui.poll import Poll, TierRate, router_counters
from kvctl.tui.prefixes import Prefix, shared_prefixes

RECORDING = "kvctl top recording"
"""The first line of a recording says what it is and which router it watched; one poll a line follows."""


AUDIT_WINDOW_S = 300.0
"""The decision audit's window on the audit line: doctor's routing finding judges the same 5 minutes."""
NO_AUDIT = "not on this router (its kvctl serve is from before the decision audit)"
"""What the audit line says for a router that answers `GET /v1/audit` with 404."""


class EndOfRecording(Exception):
    """A replay has shown its last poll."""


class Source(Protocol):
    label: str  # the router URL, as the header shows it

    async def poll(self) -> Poll: ...

    async def reset(self, model: str, worker_id: int, dp_rank: int) -> Cleared: ...

    async def prefixes(self, model: str) -> tuple[Prefix, ...]: ...

    async def aclose(self) -> None: ...


class TierFeed:
    """Tier hit rates for the tiers panel, by the same math as `kvctl tiers`. Blocking: call it on a thread.

    Besides each tier's hit rate: a router's predicted hit rate (tier `router`: kvctl's or Dynamo's
    `dynamo_component_router_kv_hit_rate`) and the share of prompt tokens a Dynamo frontend's engines reported
    cached (tier `cached`); `note` says how many requests a Dynamo frontend's router queue holds, and names the
    instances that export no tier counters (None when neither needs saying).

    Prometheus is asked for `increase()` over `window_s`; engines' `/metrics` are scraped each refresh and the
    window is the time since the previous scrape (so the first refresh has no rates yet). Prometheus is asked
    at most every `every_s`: its window is minutes long, and a query a second would be a needless load.
    """

    def __init__(self, *, prometheus: str | None = None, metrics: list[str] | None = None, auth: Auth | None = None,
                 timeout: float = 5.0, window_s: float = 300.0, every_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.prometheus = prometheus.rstrip("/") if prometheus else None
        self.auth = auth or Auth()
        self.timeout = timeout
        self.window_s = window_s
        self.every_s = every_s
        self._clock = clock
        self._scraper = Scraper(metrics, auth=self.auth, timeout=timeout) if metrics else None
        self._previous: dict[str, tuple[float, list[Sample]]] = {}
        self._rates: tuple[TierRate, ...] = ()
        self._refreshed: float | None = None
        self.note: str | None = None

    def rates(self) -> tuple[TierRate, ...]:
        now = self._clock()
        if self.prometheus is not None and self._refreshed is not None and now - self._refreshed < self.every_s:
            return self._rates
        windows = self._windows(now)
        tier_report = report(windows)
        self._rates = (*(TierRate(r.instance, tier, r.value, r.family)
                         for tier in CHECK_TIERS for r in hit_rates(tier_report, tier) if r.value is not None),
                       *(TierRate(r.instance, _PANEL_METRICS[r.metric], r.value, r.family)
                         for r in tier_report.readings if r.metric in _PANEL_METRICS and r.value is not None))
        self.note = "; ".join(filter(None, [queue_note(windows), tier_report.untiered_note])) or None
        self._refreshed = now
        return self._rates

    def _windows(self, now: float) -> list[Window]:
        if self.prometheus is not None:
            return prometheus_windows(self.prometheus, window_s=self.window_s, auth=self.auth, timeout=self.timeout)
        assert self._scraper is not None
        windows = []
        for url in self._scraper.urls:
            samples = self._scraper.scrape(url)
            previous = self._previous.get(url)
            if previous is not None:
                windows.append(Window(url, now - previous[0], increases(previous[1], samples)))
            self._previous[url] = (now, samples)
        return windows

    def close(self) -> None:
        if self._scraper is not None:
            self._scraper.close()


_PANEL_METRICS = {"predicted_hit_rate": "router", "cached_share": "cached"}
"""Ratios the tiers panel shows besides tiers' hit rates, under these names in its tier column."""


class LiveSource:
    """A router polled over HTTP: `/v1/status`, `/v1/workers` and `/v1/audit` concurrently, `/metrics` for the
    counters."""

    def __init__(self, client: AsyncRouterClient, *, token: str | None = None, timeout: float = 5.0,
                 tiers: TierFeed | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.label = client.base_url
        self.token = token
        self.timeout = timeout
        self.tiers = tiers
        self._clock = clock
        self._metrics = Scraper([metrics_url(client.base_url)], auth=Auth(token=token), timeout=timeout)

    async def poll(self) -> Poll:
        started = self._clock()
        answers = await asyncio.gather(
            self.client.send(calls.status()), self.client.send(calls.workers()),
            asyncio.to_thread(self._metrics.scrape, self._metrics.urls[0]),
            self.client.send(calls.audit(AUDIT_WINDOW_S)), return_exceptions=True)
        at = (started + self._clock()) / 2  # the middle of the requests: what the counters' rates divide by
        status, workers, samples, audit = answers  # all awaited, the first failure in call order reported
        if isinstance(status, BaseException):
            raise status
        if isinstance(workers, BaseException):
            raise workers
        if isinstance(samples, BaseException):
            raise samples
        audited: dict[str, Any] | None
        audit_note: str | None
        if isinstance(audit, NotFound):  # a router from before the audit: the rest of the frame stays live
            audited, audit_note = None, NO_AUDIT
        elif isinstance(audit, BaseException):
            raise audit
        else:
            audited, audit_note = msgspec.to_builtins(audit), None
        tiers, tiers_error = await self._tier_rates()
        # Decoded into their Structs (a router of another version is an error saying so), kept as their JSON: a
        # poll is what a recording holds, and replays into the same frames whichever kvctl reads it.
        return Poll(at=at, status=msgspec.to_builtins(status), workers=msgspec.to_builtins(workers.workers),
                    counters=router_counters(samples),
                    tiers=tiers, tiers_error=tiers_error, tiers_note=self.tiers.note if self.tiers else None,
                    audit=audited, audit_note=audit_note)

    async def _tier_rates(self) -> tuple[tuple[TierRate, ...] | None, str | None]:
        """The tiers panel's rates; a tiers source that fails leaves the rest of the frame live."""
        if self.tiers is None:
            return None, None
        try:
            return await asyncio.to_thread(self.tiers.rates), None
        except KvctlError as exc:
            return (), exc.message

    async def reset(self, model: str, worker_id: int, dp_rank: int) -> Cleared:
        return await self.client.send(calls.reset(model=model, worker_id=worker_id, dp_rank=dp_rank))

    async def prefixes(self, model: str) -> tuple[Prefix, ...]:
        from kvctl.client.sources import router_events

        def read() -> tuple[Prefix, ...]:
            return shared_prefixes(router_events(self.label, model=model, token=self.token, timeout=self.timeout))

        return await asyncio.to_thread(read)

    async def aclose(self) -> None:
        self._metrics.close()
        if self.tiers is not None:
            self.tiers.close()
        await self.client.aclose()


class Recorder:
    """Any source, with each poll also written to a file that `--replay` shows again."""

    def __init__(self, source: Source, path: Path) -> None:
        self.source = source
        self.label = source.label
        self._file: IO[str] = path.open("w", encoding="utf-8")
        self._file.write(json.dumps({"recording": RECORDING, "version": 1, "router": source.label}) + "\n")

    async def poll(self) -> Poll:
        poll = await self.source.poll()
        self._file.write(poll.to_json() + "\n")
        self._file.flush()
        return poll

    async def reset(self, model: str, worker_id: int, dp_rank: int) -> Cleared:
        return await self.source.reset(model, worker_id, dp_rank)

    async def prefixes(self, model: str) -> tuple[Prefix, ...]:
        return await self.source.prefixes(model)

    async def aclose(self) -> None:
        self._file.close()
        await self.source.aclose()


class ReplaySource:
    """A recording's polls in order, one per refresh; rates come out as they were, from the recorded times."""

    def __init__(self, path: Path) -> None:
        try:
            self._file: IO[str] = path.open(encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"--replay {path}: {exc}") from None
        try:
            first = json.loads(self._file.readline() or "null")
        except ValueError:
            first = None
        if not isinstance(first, dict) or first.get("recording") != RECORDING:
            self._file.close()
            raise UsageError(f"--replay {path}: not a `kvctl top --record` file")
        self.label = f"{first['router']} (replay)"
        self._lines: Iterator[str] = iter(self._file)

    async def poll(self) -> Poll:
        line = next(self._lines, None)
        if line is None:
            raise EndOfRecording
        try:
            return Poll.from_json(line)
        except (ValueError, KeyError, TypeError) as exc:
            raise KvctlError(f"a malformed poll in the recording: {exc}") from None

    async def reset(self, model: str, worker_id: int, dp_rank: int) -> Cleared:
        raise UsageError("a recording cannot be reset")

    async def prefixes(self, model: str) -> tuple[Prefix, ...]:
        raise KvctlError("recordings keep polls, not the tree")

    async def aclose(self) -> None:
        self._file.close()
