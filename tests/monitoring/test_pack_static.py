"""The monitoring pack without a server: promtool's own checks and unit tests, every alert's runbook link and
first command, the thresholds it shares with `kvctl doctor`, and the dashboard's shape."""

from __future__ import annotations

import inspect
import re
import shlex
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import httpx
import pytest
import yaml

from kvctl.core.doctor import Limits, check_hit_rates
from kvctl.core.doctor.routing_audit import MIN_DECISIONS, OPTIMAL_FLOOR
from tests.commands.test_examples_parse import parse
from tests.monitoring.pack import PACK, RULES, UNIT_TESTS, alerts, dashboard, panels, variable_lookups

PROMTOOL = shutil.which("promtool")
RUNBOOK = PACK.parents[1] / "docs" / "runbook.md"
ALERTS = alerts()


def promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    if PROMTOOL is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`; .ci/run installs it)")
    return subprocess.run([PROMTOOL, *map(str, args)], capture_output=True, text=True, timeout=60, check=False)


def test_promtool_checks_the_rule_files() -> None:
    result = promtool("check", "rules", *RULES)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_pass() -> None:
    result = promtool("test", "rules", *UNIT_TESTS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_and_recording_rule_has_a_unit_test() -> None:
    """An alert is tested when a unit test expects it to fire (and each test group has a moment where nothing
    fires); a recording rule when a unit test queries its series."""
    text = "\n".join(path.read_text() for path in UNIT_TESTS)
    assert sorted(set(re.findall(r"alertname: (\w+)", text))) == sorted(ALERTS)
    tested = set(re.findall(r"- expr: (\S+)", text))
    records = {rule for path in RULES for rule in re.findall(r"- record: (\S+)", path.read_text())}
    assert records <= tested, records - tested
    assert text.count("exp_alerts: []") >= len(ALERTS)


def _rendered() -> dict[str, dict[str, str]]:
    """Each alert's annotations as promtool renders them in the unit tests (which `test_promtool_unit_tests_pass`
    holds to the rules): the links and commands an on-call engineer gets, templates filled in."""
    rendered: dict[str, dict[str, str]] = {}
    for path in UNIT_TESTS:
        for group in yaml.safe_load(path.read_text()).get("tests", []):
            for case in group.get("alert_rule_test", []):
                for alert in case.get("exp_alerts", []):
                    rendered.setdefault(case["alertname"], alert["exp_annotations"])
    return rendered


@pytest.mark.parametrize("name", sorted(ALERTS))
def test_each_alert_links_its_routers_runbook_and_names_a_command_that_parses(name: str) -> None:
    """The link is absolute: the alerting router serves its runbook at /runbook (issue 37)."""
    annotations = _rendered()[name]
    url = httpx.URL(annotations["runbook_url"])
    assert url.scheme == "http" and url.port and url.path == "/runbook", annotations["runbook_url"]
    assert f'<a id="{url.fragment}"></a>' in RUNBOOK.read_text(), annotations["runbook_url"]
    assert f"`{name}`" in RUNBOOK.read_text(), f"the runbook's section names no alert {name}"
    argv = shlex.split(annotations["kvctl_command"])
    assert argv[0] == "kvctl" and "{{" not in annotations["kvctl_command"], annotations["kvctl_command"]
    assert f"http://{url.netloc.decode()}" in argv, "the command and the link name different routers"
    parse(argv[1:])


def test_the_alerts_cover_every_runbook_anchor() -> None:
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', RUNBOOK.read_text()))
    linked = {re.search(r"/runbook#([\w-]+)", rule["annotations"]["runbook_url"])[1] for rule in ALERTS.values()}
    assert linked == anchors


def _threshold(name: str) -> list[float]:
    return [float(x) for x in re.findall(r"[<>]=? ([0-9.]+)", ALERTS[name]["expr"])]


def test_alert_thresholds_are_kvctl_doctors() -> None:
    """Written in the same terms as `kvctl doctor`: a page and a doctor run agree on what is wrong."""
    hit_rates = inspect.signature(check_hit_rates).parameters
    assert _threshold("KvctlOverlapAlwaysZero") == [hit_rates["zero"].default, hit_rates["high"].default]
    assert _threshold("KvctlPredictedHitsNotReal") == [hit_rates["gap"].default]
    assert _threshold("KvctlReplicasDiverge") == [Limits().divergence_share]
    assert _threshold("KvctlIndexNearCap") == [Limits().near_cap]
    # the audit's `routing`: under 70 % optimal, judged over at least 20 decisions with cache to find in 5 minutes
    # (a rate floor: 20 per 300 s)
    assert _threshold("KvctlRoutingMissesCache") == [OPTIMAL_FLOOR, MIN_DECISIONS]
    assert _threshold("KvctlRouterIgnoresCache") == [OPTIMAL_FLOOR, MIN_DECISIONS, 0]
    assert all(f">= {MIN_DECISIONS} / 300" in ALERTS[name]["expr"]
               for name in ("KvctlRoutingMissesCache", "KvctlRouterIgnoresCache"))


def test_the_dashboard_has_unique_panel_ids_and_its_variables() -> None:
    board = dashboard()
    ids = Counter(panel["id"] for panel in panels(board))
    assert not [i for i, n in ids.items() if n > 1], ids
    assert [name for name, _, _ in variable_lookups(board)] == ["model", "worker"]
    assert all(target["datasource"]["uid"] == "${datasource}" for panel in panels(board)
               for target in panel.get("targets", []))
