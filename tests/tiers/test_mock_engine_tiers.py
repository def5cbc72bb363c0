"""`kvctl tiers` on a mock engine's own /metrics: only the tiers the engine has are exported, so a tier it does
not have is never shown as a 0.0 % hit rate measured on it."""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from http.server import ThreadingHTTPServer

import pytest

from kvctl.core.events.types import Tier
from kvctl.mock.cache import Allocation, Transfers
from kvctl.mock.metrics import EngineMetrics
from tests.tiers.conftest import tiers
from tests.tiers.exporter import metrics_handler


@contextmanager
def engine_metrics(lower_tiers: Collection[Tier]) -> Iterator[tuple[str, EngineMetrics]]:
    """A mock engine's metrics, served at /metrics on a loopback port, after one request with device hits."""
    metrics = EngineMetrics(model_name="m", block_size=4, usage=lambda: 0.5, running=lambda: 0, waiting=lambda: 0,
                            transfers=Transfers() if lower_tiers else None, lower_tiers=lower_tiers)
    metrics.record(Allocation(generation=0, blocks=(), prompt_blocks=4, hits={Tier.device: 2}, events=()),
                   prompt_tokens=16)
    server = ThreadingHTTPServer(("127.0.0.1", 0), metrics_handler(metrics.render, path="/metrics"))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics", metrics
    finally:
        server.shutdown()
        server.server_close()


def rows_by_tier(stdout: str) -> set[str]:
    """The TIER column of the one table `tiers --wait` prints (under its title and header)."""
    return {line.split()[1] for line in stdout.splitlines()[2:] if line.strip()}


def test_an_engine_without_lower_tiers_shows_none_and_says_so_once() -> None:
    with engine_metrics(()) as (url, _):
        result = tiers("--window", "250ms", "--wait", "--metrics", url)
    assert result.exit_code == 0, result.output
    assert rows_by_tier(result.stdout) == {"device"}, result.stdout
    assert result.stderr.count("no tier counters exported by") == 1


@pytest.mark.parametrize(("lower", "shown"), [((Tier.host_pinned,), {"device", "host"}),
                                              ((Tier.host_pinned, Tier.disk), {"device", "host", "disk"})])
def test_only_the_tiers_an_engine_has(lower: tuple[Tier, ...], shown: set[str]) -> None:
    with engine_metrics(lower) as (url, _):
        result = tiers("--window", "250ms", "--wait", "--metrics", url)
    assert result.exit_code == 0, result.output
    assert rows_by_tier(result.stdout) - {"-"} == shown, result.stdout
