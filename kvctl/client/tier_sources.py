"""Where `kvctl tiers` gets its samples: a Prometheus server, or engines' `/metrics` scraped twice.

Both end as `core.tiers.Window`s (counters as increases over the window, gauges as last values), so
the math is the same whichever source was used. A Prometheus has every window at once; an engine's
first scrape gives its counters since it started at once, and the window only once it has passed.
Transport failures become kvctl errors naming the URL (unreachable: exit 3, what a monitoring system reads
as UNKNOWN).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import httpx

from kvctl.client._base import pool_limits
from kvctl.client.deadline import deadline_transport, within
from kvctl.core.tiers import Sample, Window, family_of, increases
from kvctl.errors import ApiError, KvctlError, TimedOut, Unreachable


@dataclass(frozen=True, slots=True)
class Auth:
    """Basic auth or a bearer token, for Prometheus and for engines' endpoints alike."""

    user: str | None = None
    password: str | None = None
    token: str | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def basic(self) -> tuple[str, str] | None:
        return (self.user, self.password or "") if self.user is not None else None


@contextmanager
def _reaching(what: str, url: str, timeouts: tuple[type[Exception], ...],
              failures: tuple[type[Exception], ...]) -> Iterator[None]:
    """One library's transport exceptions as kvctl errors naming `url`."""
    try:
        yield
    except timeouts:
        raise TimedOut(f"{what} at {url} did not answer in time", hint="raise --timeout") from None
    except failures as exc:
        raise Unreachable(f"cannot reach {what} at {url}: {exc or type(exc).__name__}") from None


def _status_error(what: str, url: str, status: int, detail: str) -> ApiError:
    hint = "pass --auth-user/--auth-password or --bearer-token" if status in (401, 403) else None
    return ApiError(f"{what} at {url}: {detail} (HTTP {status})", status=status, hint=hint)


# ----- Prometheus -------------------------------------------------------------------------------------------

def prometheus_windows(url: str, *, window_s: float, auth: Auth, timeout: float) -> list[Window]:
    """One instant query per metric name kvctl reads and the server has: `increase(name[window])` for counters,
    the name itself for gauges. Results are grouped by their `instance` label."""
    import requests
    from prometheus_api_client import PrometheusApiClientException, PrometheusConnect
    from urllib3.util.retry import Retry

    by_instance: dict[str, list[Sample]] = defaultdict(list)
    window = f"{round(window_s * 1000)}ms"
    with (_reaching("Prometheus", url, (requests.Timeout,), (requests.ConnectionError,)),
          PrometheusConnect(url, headers=auth.headers(), auth=auth.basic(), retry=Retry(total=0),
                            timeout=timeout) as prom):
        try:
            families = {name: found[0] for name in prom.all_metrics() if (found := family_of(name)) is not None}
            for name, family in families.items():
                for series in prom.custom_query(f"increase({name}[{window}])" if family.counter else name):
                    labels = {k: v for k, v in series["metric"].items() if k != "__name__"}
                    instance = labels.get("instance") or labels.get("job") or "-"
                    by_instance[instance].append(Sample(name, labels, float(series["value"][1])))
        except PrometheusApiClientException as exc:
            status, _, detail = str(exc).removeprefix("HTTP Status Code ").partition(" ")
            raise _status_error("Prometheus", url, int(status) if status.isdigit() else 0, detail) from None
    return [Window(instance, window_s, tuple(samples)) for instance, samples in by_instance.items()]


# ----- /metrics endpoints -----------------------------------------------------------------------------------

def metrics_url(url: str) -> str:
    """An engine's address with `/metrics` added when no path is given."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    return urlunsplit(parts._replace(path=parts.path if parts.path.strip("/") else "/metrics"))


def parse_metrics(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition. The parser renames counter *families* (never mind: samples
    keep their names, and kvctl matches names with or without `_total`)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        return [Sample(s.name, s.labels, float(s.value))
                for family in text_string_to_metric_families(text) for s in family.samples]
    except ValueError as exc:
        raise KvctlError(f"not a Prometheus exposition: {exc}") from None


@dataclass(frozen=True, slots=True)
class Scrape:
    """Every endpoint's samples, each with the moment it was read."""

    taken: Mapping[str, tuple[float, list[Sample]]]  # url -> (moment, samples)

    @property
    def started(self) -> float:
        return min(at for at, _ in self.taken.values())

    def since_start(self) -> list[Window]:
        """Each endpoint's counters as they stand: increases since it (re)started, at once. How long ago that
        was is unknown, so the window is infinite and `core.tiers` shows no rates for it."""
        return [Window(urlsplit(url).netloc, math.inf, increases((), samples))
                for url, (_, samples) in self.taken.items()]

    def until(self, later: Scrape) -> list[Window]:
        """The windows from this scrape to `later`: each endpoint's between its own two scrapes, so a slow
        endpoint skews nothing."""
        return [Window(urlsplit(url).netloc, later.taken[url][0] - at, increases(before, later.taken[url][1]))
                for url, (at, before) in self.taken.items()]


class Scraper:
    """Blocking GETs of engines' `/metrics`. `timeout` bounds each whole scrape (a deadline, however slowly an
    endpoint answers)."""

    def __init__(self, urls: list[str], *, auth: Auth, timeout: float) -> None:
        self.urls = [metrics_url(u) for u in urls]
        self._timeout = timeout
        self._http = httpx.Client(headers=auth.headers(), auth=auth.basic(), timeout=timeout,
                                  transport=deadline_transport(verify=True, limits=pool_limits()))

    def scrape(self, url: str) -> list[Sample]:
        with (_reaching("the metrics endpoint", url, (httpx.TimeoutException,), (httpx.TransportError,)),
              within(self._timeout)):
            response = self._http.get(url)
        if not response.is_success:
            raise _status_error("the metrics endpoint", url, response.status_code, response.reason_phrase)
        return parse_metrics(response.text)

    def scrape_all(self, clock: Callable[[], float] = time.monotonic) -> Scrape:
        return Scrape({url: self._timed(url, clock) for url in self.urls})

    def since_start(self) -> list[Window]:
        """Each endpoint's counters since it started, from one scrape: ratios of counters over the whole
        life of an engine ("has the router ever predicted a hit?")."""
        return self.scrape_all().since_start()

    def answers(self, window_s: float, *, since_start: bool,
                wait_until: Callable[[float], None]) -> Iterator[list[Window]]:
        """Windows as they become known: the counters since each engine started at once (when `since_start`),
        then a window of `window_s` once it has passed (`wait_until` a `time.monotonic` moment), and the next
        ones, each from the end of the last."""
        before = self.scrape_all()
        if since_start:
            yield before.since_start()
        while True:
            wait_until(before.started + window_s)
            after = self.scrape_all()
            yield before.until(after)
            before = after

    def _timed(self, url: str, clock: Callable[[], float]) -> tuple[float, list[Sample]]:
        """A scrape and its moment: the middle of the request, as a new connection's setup would skew its start."""
        started = clock()
        samples = self.scrape(url)
        return (started + clock()) / 2, samples

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Scraper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
