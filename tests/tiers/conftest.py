"""Exporters of every tier family (one per KVBM spelling), and a check of `kvctl tiers -o json` against the truth."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from kvctl.cli import app
from tests.tiers.exporter import EXPECTED, FAILURES_PER_S, TierExporter

TOLERANCE = 0.02


@pytest.fixture
def exporters() -> Iterator[list[TierExporter]]:
    """Two instances: KVBM's `object` spelling and the `remote` one (with vLLM's older usage gauge)."""
    started = [TierExporter(), TierExporter(remote=True)]
    yield started
    for exporter in started:
        exporter.close()


def tiers(*args: str, env: dict[str, str] | None = None) -> Any:
    """`kvctl tiers ARGS` in-process, as a script runs it."""
    return CliRunner().invoke(app, ["tiers", *args], env=env)


def tiers_json(*args: str) -> dict[str, Any]:
    result = tiers("-o", "json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def assert_truth(doc: dict[str, Any], instance: str, window_s: float) -> None:
    """Every expected number of `instance`, within 2 %, and every family found."""
    readings = [r for r in doc["readings"] if r["instance"] == instance]
    truth = {**EXPECTED, **{key: rate * window_s for key, rate in FAILURES_PER_S.items()}}
    for (tier, metric, family), value in truth.items():
        matches = [r for r in readings if (r["tier"], r["metric"]) == (tier, metric) and r["family"].startswith(family)]
        assert len(matches) == 1, (tier, metric, family, matches)
        assert matches[0]["value"] == pytest.approx(value, rel=TOLERANCE), (tier, metric, family)
    assert doc["families"]["missing"] == []
