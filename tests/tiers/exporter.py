"""A test exporter of every family `kvctl tiers` reads, with counters that grow at known rates.

Counters are linear in time (`BASE + rate · t`), computed when scraped, so the truth over any window is
exact: a rate is the rate, a ratio of two counters the ratio of their rates. The vLLM, SGLang, LMCache
and router halves go through prometheus_client (its own registry; counters get `_total`); KVBM is Rust
and writes counters without `_total`, which prometheus_client cannot produce, so that half is text, as
in `kvctl.mock.metrics`. `remote=True` uses the KVBM spelling `remote` for `object` and vLLM's older
`gpu_cache_usage_perc`. `reset()` restarts every counter from 0, as an engine restart does.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

BASE = 1000.0  # far from 0, so Prometheus' extrapolation never stops at a counter's start
QUERIES = 500.0  # vLLM prompt tokens queried per second
HITS = 150.0  # of which device prefix-cache hits
BY_SOURCE = {"device": 150.0, "host": 100.0, "disk": 40.0, "p2p": 6.0, "external_unspecified": 4.0}
SGLANG_CACHED = {"device": 90.0, "host": 30.0, "storage": 30.0}
LMCACHE_HIT, LMCACHE_REQUESTED = 120.0, 400.0
ROUTES, PREDICTED_MEAN = 20.0, 0.625
DYNAMO_ROUTES, DYNAMO_PREDICTED_MEAN = 10.0, 0.25
DYNAMO_REQUESTS, DYNAMO_CACHED, DYNAMO_INPUT = 4.0, 96.0, 256.0  # frontend: requests, cached and prompt tokens /s
OFFLOAD = {"d2h": 8.0, "h2d": 3.0, "d2d": 1.0, "d2o": 2.0}
ONBOARD = {"h2d": 5.0, "d2d": 2.5, "o2d": 0.5}
MATCHED = 140.0
FAILURES = {"read": 0.5, "write": 0.25}
GAUGES = {"kvbm_host": 0.35, "kvbm_disk": 0.15, "kvbm_object": 0.05, "usage": 0.42, "sglang_hit": 0.6,
          "sglang_usage": 0.3, "lookup": 0.7, "retrieve": 0.55, "dynamo_usage": 0.33, "dynamo_hit": 0.45}

_VLLM_TIERS = {"device": "device", "host": "host", "disk": "disk", "p2p": "p2p", "external": "external_unspecified"}
_SGLANG_TIERS = {"device": "device", "host": "host", "disk": "storage"}

# What `kvctl tiers` must report: (tier, metric, the start of its family's name) -> the truth.
EXPECTED = {
    ("device", "hit_rate", "vllm:"): HITS / QUERIES,
    **{(tier, "hit_rate", "vllm:"): BY_SOURCE[source] / QUERIES for tier, source in _VLLM_TIERS.items()
       if tier != "device"},
    **{(tier, "share", "vllm:"): BY_SOURCE[source] / sum(BY_SOURCE.values()) for tier, source in _VLLM_TIERS.items()},
    **{(tier, "cached_tokens_per_s", "vllm:"): BY_SOURCE[source] for tier, source in _VLLM_TIERS.items()},
    ("device", "usage", "vllm:"): GAUGES["usage"],
    ("device", "hit_rate", "sglang:"): GAUGES["sglang_hit"],
    ("device", "usage", "sglang:"): GAUGES["sglang_usage"],
    **{(tier, "share", "sglang:"): SGLANG_CACHED[source] / sum(SGLANG_CACHED.values())
       for tier, source in _SGLANG_TIERS.items()},
    **{(tier, "cached_tokens_per_s", "sglang:"): SGLANG_CACHED[source] for tier, source in _SGLANG_TIERS.items()},
    ("external", "hit_rate", "lmcache:"): LMCACHE_HIT / LMCACHE_REQUESTED,
    ("external", "lookup_hit_rate", "lmcache:"): GAUGES["lookup"],
    ("external", "retrieve_hit_rate", "lmcache:"): GAUGES["retrieve"],
    (None, "predicted_hit_rate", "kvctl_"): PREDICTED_MEAN,
    (None, "predicted_hit_rate", "dynamo_"): DYNAMO_PREDICTED_MEAN,
    (None, "cached_share", "dynamo_frontend_"): DYNAMO_CACHED / DYNAMO_INPUT,
    ("device", "usage", "dynamo_component_gpu"): GAUGES["dynamo_usage"],
    ("device", "hit_rate", "dynamo_component_kv"): GAUGES["dynamo_hit"],
    ("host", "hit_rate", "kvbm_"): GAUGES["kvbm_host"],
    ("disk", "hit_rate", "kvbm_"): GAUGES["kvbm_disk"],
    ("object", "hit_rate", "kvbm_"): GAUGES["kvbm_object"],
    ("host", "offload_blocks_per_s", "kvbm_"): OFFLOAD["d2h"],
    ("disk", "offload_blocks_per_s", "kvbm_"): OFFLOAD["h2d"] + OFFLOAD["d2d"],
    ("object", "offload_blocks_per_s", "kvbm_"): OFFLOAD["d2o"],
    ("host", "onboard_blocks_per_s", "kvbm_"): ONBOARD["h2d"],
    ("disk", "onboard_blocks_per_s", "kvbm_"): ONBOARD["d2d"],
    ("object", "onboard_blocks_per_s", "kvbm_"): ONBOARD["o2d"],
    (None, "matched_tokens_per_s", "kvbm_"): MATCHED,
}
FAILURES_PER_S = {("object", f"{op}_failures", "kvbm_"): rate for op, rate in FAILURES.items()}
"""Failures are counts over the window: the truth is the rate times the window's length."""


class TierExporter:
    """Serves `/metrics` on a free loopback port until `close()`; optional basic or bearer auth."""

    def __init__(self, *, remote: bool = False, kvbm: bool = True, engines: bool = True,
                 auth: tuple[str, str] | str | None = None) -> None:
        self.remote, self.kvbm, self.engines = remote, kvbm, engines
        self._started = time.monotonic()
        self._base = BASE
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(self))
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), metrics_handler(self.body, _expected_header(auth)))
        self._thread = threading.Thread(target=self._server.serve_forever, name="tier-exporter", daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self.instance = self.url.removeprefix("http://")

    def counter(self, rate: float) -> float:
        return self._base + rate * (time.monotonic() - self._started)

    def reset(self) -> None:
        """Every counter back to 0 now, then growing at its rate again: an engine restart."""
        self._started, self._base = time.monotonic(), 0.0

    def body(self) -> bytes:
        text = generate_latest(self.registry) if self.engines else b""
        return text + (self._kvbm_text().encode() if self.kvbm else b"")

    def _kvbm_text(self) -> str:
        obj = "remote" if self.remote else "object"
        o = "r" if self.remote else "o"
        families = [(f"kvbm_{tier}_cache_hit_rate", "gauge", GAUGES[f"kvbm_{tier}"]) for tier in ("host", "disk")]
        families.append((f"kvbm_{obj}_cache_hit_rate", "gauge", GAUGES["kvbm_object"]))
        families += [(f"kvbm_{kind}_blocks_{d.replace('o', o)}", "counter", self.counter(r))
                     for kind, rates in (("offload", OFFLOAD), ("onboard", ONBOARD)) for d, r in rates.items()]
        families.append(("kvbm_matched_tokens", "counter", self.counter(MATCHED)))
        families += [(f"kvbm_{obj}_{op}_failures", "counter", self.counter(r)) for op, r in FAILURES.items()]
        return "".join(f"# HELP {name} test\n# TYPE {name} {kind}\n{name} {value}\n" for name, kind, value in families)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


class _EngineCollector:
    """vLLM, SGLang, LMCache and router families, their counters read off the clock at each scrape."""

    def __init__(self, exporter: TierExporter) -> None:
        self.x = exporter

    def collect(self) -> Iterator[Metric]:
        x, model = self.x, ["m"]
        yield _counter("vllm:prefix_cache_queries", ["model_name"], [(model, x.counter(QUERIES))])
        yield _counter("vllm:prefix_cache_hits", ["model_name"], [(model, x.counter(HITS))])
        yield _counter("vllm:prompt_tokens_cached_by_source", ["model_name", "source"],
                       [([*model, source], x.counter(rate)) for source, rate in BY_SOURCE.items()])
        usage = "vllm:gpu_cache_usage_perc" if x.remote else "vllm:kv_cache_usage_perc"
        yield _gauge(usage, GAUGES["usage"])
        yield _counter("sglang:cached_tokens", ["cache_source"],
                       [([source], x.counter(rate)) for source, rate in SGLANG_CACHED.items()])
        yield _gauge("sglang:cache_hit_rate", GAUGES["sglang_hit"])
        yield _gauge("sglang:token_usage", GAUGES["sglang_usage"])
        yield _counter("lmcache:num_hit_tokens", [], [([], x.counter(LMCACHE_HIT))])
        yield _counter("lmcache:num_requested_tokens", [], [([], x.counter(LMCACHE_REQUESTED))])
        yield _gauge("lmcache:lookup_hit_rate", GAUGES["lookup"])
        yield _gauge("lmcache:retrieve_hit_rate", GAUGES["retrieve"])
        for name, routes, mean in (("kvctl_route_predicted_hit_rate", ROUTES, PREDICTED_MEAN),
                                   ("dynamo_component_router_kv_hit_rate", DYNAMO_ROUTES, DYNAMO_PREDICTED_MEAN)):
            count = x.counter(routes)
            yield HistogramMetricFamily(name, "test", buckets=[("1.0", count), ("+Inf", count)],
                                        sum_value=count * mean)
        requests = x.counter(DYNAMO_REQUESTS)  # Dynamo's frontend: per-request histograms, by model
        for name, tokens in (("dynamo_frontend_cached_tokens", DYNAMO_CACHED),
                             ("dynamo_frontend_input_sequence_tokens", DYNAMO_INPUT)):
            family = HistogramMetricFamily(name, "test", labels=["model"])
            family.add_metric(model, buckets=[("+Inf", requests)], sum_value=x.counter(tokens))
            yield family
        for name, value in (("dynamo_component_gpu_cache_usage_percent", GAUGES["dynamo_usage"]),
                            ("dynamo_component_kv_cache_hit_rate", GAUGES["dynamo_hit"])):
            gauge = GaugeMetricFamily(name, "test", labels=["model", "dynamo_component", "dp_rank"])
            gauge.add_metric([*model, "backend", "0"], value)
            yield gauge


def _counter(name: str, labels: list[str], values: list[tuple[list[str], float]]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, "test", labels=labels)
    for label_values, value in values:
        family.add_metric(label_values, value)
    return family


def _gauge(name: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, "test", value=value)


def _expected_header(auth: tuple[str, str] | str | None) -> str | None:
    if isinstance(auth, tuple):
        return "Basic " + base64.b64encode(":".join(auth).encode()).decode()
    return None if auth is None else f"Bearer {auth}"


def metrics_handler(body: Callable[[], bytes], authorization: str | None = None,
                    path: str | None = None) -> type[BaseHTTPRequestHandler]:
    """An exposition endpoint answering `body()`: only at `path` when given (else 404), only to `authorization`
    when given (else 401)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if path is not None and self.path != path:
                self.send_error(404)
                return
            if authorization is not None and self.headers.get("Authorization") != authorization:
                self.send_response(401)
                self.end_headers()
                return
            answer = body()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    return Handler
