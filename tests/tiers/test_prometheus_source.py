"""`kvctl tiers --prometheus` against a real Prometheus scraping the test exporters every second."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tiers.conftest import assert_truth, tiers, tiers_json
from tests.tiers.exporter import TierExporter
from tests.tiers.prometheus_server import free_port, prometheus, wait_for_scrapes

WINDOW = "5s"


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[TierExporter]]]:
    """One Prometheus for the module, with enough 1 s scrapes of both exporters for a 5 s window."""
    exporters = [TierExporter(), TierExporter(remote=True)]
    try:
        with prometheus([x.instance for x in exporters], Path(tmp_path_factory.mktemp("prometheus"))) as url:
            wait_for_scrapes(url, targets=len(exporters), scrapes=7)
            yield url, exporters
    finally:
        for exporter in exporters:
            exporter.close()


def test_every_family_within_two_percent(scraped: tuple[str, list[TierExporter]]) -> None:
    url, exporters = scraped
    doc = tiers_json("--prometheus", url, "--window", WINDOW)
    assert doc["basis"] == "window"  # Prometheus has the window at once: no since-start figures first
    assert [i["instance"] for i in doc["instances"]] == sorted(x.instance for x in exporters)
    for exporter in exporters:
        assert_truth(doc, exporter.instance, 5.0)


def test_url_from_the_environment_and_instance_filter(scraped: tuple[str, list[TierExporter]]) -> None:
    url, exporters = scraped
    result = tiers("-o", "json", "--window", WINDOW, "--instance", f"{exporters[1].instance}$",
                   env={"KVCTL_PROMETHEUS": url})
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [i["instance"] for i in doc["instances"]] == [exporters[1].instance]
    assert_truth(doc, exporters[1].instance, 5.0)


def test_table_is_the_window_at_once(scraped: tuple[str, list[TierExporter]]) -> None:
    url, _ = scraped
    result = tiers("--prometheus", url, "--window", WINDOW)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"over the last {WINDOW}\n")
    assert "since each engine started" not in result.stdout and "cached_tokens_per_s" in result.stdout


def test_check_on_the_disk_tier(scraped: tuple[str, list[TierExporter]]) -> None:
    url, _ = scraped
    result = tiers("--prometheus", url, "--window", WINDOW, "--tier", "disk", "--warn", "0.1", "--crit", "0.09")
    assert result.exit_code == 2, result.output  # vLLM's disk source: 40 / 500 = 8 %
    assert result.stdout.startswith("KVCTL TIERS CRITICAL - disk hit rate 8.0%")


def test_prometheus_down_exits_3_naming_the_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = tiers("--prometheus", url)
    assert result.exit_code == 3
    assert f"Prometheus at {url}" in result.stderr
