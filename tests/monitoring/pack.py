"""The monitoring pack (contrib/monitoring) as the tests load it, and the Prometheus calls they make.

Production windows and `for:` durations are minutes; the tests run a Prometheus that scrapes and evaluates every
second, so `scaled_rules` loads the rules with every minute read as a second (`[5m]` -> `[5s]`, `for: 10m` ->
`for: 10s`): the same rules, sixty times faster. Nothing else in them changes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.support import eventually

PACK = Path(__file__).resolve().parents[2] / "contrib" / "monitoring"
RULES = sorted((PACK / "rules").glob("*.yml"))
UNIT_TESTS = sorted((PACK / "tests").glob("*.yml"))
DASHBOARD = PACK / "dashboards" / "kvctl-routing.json"

_MINUTES = re.compile(r"(?<=[\[\s])(\d+)m(?=[\]\s]|$)", re.M)
SCALED_RATE_INTERVAL = "5s"
"""What `$__rate_interval` stands for in the tests: Grafana's is at least four scrape intervals."""


def scaled_rules(workdir: Path) -> list[Path]:
    """The rule files with minutes read as seconds, written to `workdir`."""
    out = []
    for path in RULES:
        scaled = workdir / path.name
        scaled.write_text(_MINUTES.sub(r"\1s", path.read_text()))
        out.append(scaled)
    return out


def rules() -> Iterator[dict[str, Any]]:
    """Every rule of the pack, recording and alerting."""
    for path in RULES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            yield from group["rules"]


def alerts() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for rule in rules() if "alert" in rule}


def recorded() -> list[str]:
    return sorted({rule["record"] for rule in rules() if "record" in rule})


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows included, and those nested in collapsed rows."""
    out = []
    for panel in board["panels"]:
        out += [panel, *panel.get("panels", [])]
    return out


def panel_queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every query target, its variables set to 'all' as Grafana would send them."""
    return [(panel["title"], _all(target["expr"])) for panel in panels(board) for target in panel.get("targets", [])]


def _all(expr: str) -> str:
    return re.sub(r"\$(model|worker)\b", ".*", expr).replace("$__rate_interval", SCALED_RATE_INTERVAL)


_LABEL_VALUES = re.compile(r"label_values\((.+),\s*(\w+)\)")


def variable_lookups(board: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(variable, series selector, label) of every `label_values(selector, label)` query variable."""
    out = []
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            match = _LABEL_VALUES.fullmatch(var["query"]["query"])
            assert match, f"variable {var['name']}: not label_values(selector, label): {var['query']}"
            out.append((var["name"], _all(match.group(1)), match.group(2)))
    return out


class Prom:
    """The few HTTP API calls the tests make of a Prometheus server."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=5.0)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result; AssertionError naming the query when Prometheus refuses it (a parse error)."""
        answer = self.http.get("/api/v1/query", params={"query": expr})
        assert answer.status_code == 200, f"{expr}: {answer.text}"
        return answer.json()["data"]["result"]  # type: ignore[no-any-return]

    def label_values(self, selector: str, label: str) -> list[str]:
        answer = self.http.get(f"/api/v1/label/{label}/values", params={"match[]": selector})
        assert answer.status_code == 200, f"{selector}: {answer.text}"
        return answer.json()["data"]  # type: ignore[no-any-return]

    def alerts(self) -> list[dict[str, Any]]:
        """Alerts pending or firing."""
        return self.http.get("/api/v1/alerts").json()["data"]["alerts"]  # type: ignore[no-any-return]

    def until(self, found: Callable[[], Any], what: str, timeout: float) -> Any:
        return eventually(found, what, timeout=timeout, interval=0.25)

    def close(self) -> None:
        self.http.close()
