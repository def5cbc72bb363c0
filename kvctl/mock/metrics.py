"""A mock engine's `/metrics`: vLLM's names and labels, plus Dynamo KVBM's when tiers are on (docs/contract.md).

vLLM exports through prometheus_client (labels `model_name`, `engine`; counters get `_total`),
so the vLLM half uses prometheus_client with one registry per engine. KVBM is Rust: no labels,
counters without `_total`, integer values. prometheus_client cannot write that shape (it renames
every counter family to `*_total` in the TYPE line), so the KVBM half is written as text here.

KVBM's hit rates are a sliding window over the last 1000 requests: Σ blocks from a tier /
Σ blocks queried, as `cache_stats.rs` computes them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvctl.core.events.types import Tier
from kvctl.mock.cache import Allocation, Transfers

KVBM_WINDOW = 1000
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""vLLM's buckets for `vllm:iteration_tokens_total`: steps that fill the batched-token budget show in its bucket."""
_SOURCES = {Tier.device: "device", Tier.host_pinned: "host", Tier.disk: "disk"}


class EngineMetrics:
    """Counters fed by each admitted request, gauges read from the engine when scraped."""

    def __init__(
        self,
        *,
        model_name: str,
        block_size: int,
        usage: Callable[[], float],
        running: Callable[[], int],
        waiting: Callable[[], int],
        transfers: Transfers | None,
        lower_tiers: Collection[Tier] = (),
    ) -> None:
        """`transfers` (the cache's, when it has lower tiers) switches the KVBM metrics on; `lower_tiers` are the
        tiers the engine has below the device: only theirs are exported (a counter of a tier the engine does not
        have would read as a 0 % hit rate measured on it)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self._block_size = block_size
        self._transfers = transfers
        self._tiers = {Tier.device, *lower_tiers}
        self._window: deque[tuple[int, int, int]] = deque(maxlen=KVBM_WINDOW)  # (host, disk, queried) blocks
        self._matched_tokens = 0
        labels = {"model_name": model_name, "engine": "0"}
        names = list(labels)
        for name, doc, read in (
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
            ("vllm:num_requests_running", "Number of requests in model execution batches.", running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting),
        ):
            Gauge(name, doc, names, registry=self.registry).labels(**labels).set_function(read)
        self._queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                "queried tokens.", names, registry=self.registry).labels(**labels)
        self._hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                             names, registry=self.registry).labels(**labels)
        self._step_tokens = Histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                      names, buckets=ITERATION_TOKEN_BUCKETS, registry=self.registry).labels(**labels)
        by_source = Counter("vllm:prompt_tokens_cached_by_source", "Cached prompt tokens by source.",
                            [*names, "source"], registry=self.registry)
        self._by_source = {tier: by_source.labels(**labels, source=source) for tier, source in _SOURCES.items()
                           if tier in self._tiers}

    def record(self, allocation: Allocation, prompt_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup."""
        self._queries.inc(prompt_tokens)
        for tier, blocks in allocation.hits.items():
            self._by_source[tier].inc(blocks * self._block_size)
        self._hits.inc(allocation.hits.get(Tier.device, 0) * self._block_size)
        if self._transfers is not None:
            host, disk = allocation.hits.get(Tier.host_pinned, 0), allocation.hits.get(Tier.disk, 0)
            self._window.append((host, disk, allocation.prompt_blocks))
            self._matched_tokens += (host + disk) * self._block_size

    def step(self, tokens: int) -> None:
        """Count one scheduler step and the tokens it computed (prefill chunks plus one per decoding request)."""
        self._step_tokens.observe(tokens)

    def render(self) -> bytes:
        """The whole `/metrics` body in Prometheus text format."""
        text = generate_latest(self.registry)
        return text if self._transfers is None else text + self._kvbm_text().encode()

    def _kvbm_text(self) -> str:
        t = self._transfers
        assert t is not None
        host, disk, queried = (sum(column) for column in zip(*self._window, strict=True)) if self._window else (0, 0, 0)
        h, d = Tier.host_pinned, Tier.disk
        families = [  # each with the tiers it needs
            ("kvbm_offload_blocks_d2h", "counter", "Blocks offloaded from device to host", t.offload_d2h, {h}),
            ("kvbm_offload_blocks_h2d", "counter", "Blocks offloaded from host to disk", t.offload_h2d, {h, d}),
            ("kvbm_offload_blocks_d2d", "counter", "Blocks offloaded from device to disk", t.offload_d2d, {d}),
            ("kvbm_onboard_blocks_h2d", "counter", "Blocks onboarded from host to device", t.onboard_h2d, {h}),
            ("kvbm_onboard_blocks_d2d", "counter", "Blocks onboarded from disk to device", t.onboard_d2d, {d}),
            ("kvbm_matched_tokens", "counter", "Tokens matched on the host and disk tiers", self._matched_tokens,
             set()),
            ("kvbm_host_cache_hit_rate", "gauge", "Host cache hit rate (0-1, sliding window)", _rate(host, queried),
             {h}),
            ("kvbm_disk_cache_hit_rate", "gauge", "Disk cache hit rate (0-1, sliding window)", _rate(disk, queried),
             {d}),
        ]
        return "".join(f"# HELP {name} {doc}\n# TYPE {name} {kind}\n{name} {value}\n"
                       for name, kind, doc, value, needs in families if needs <= self._tiers)


def _rate(part: int, whole: int) -> float:
    return part / whole if whole else 0.0
