"""`kvctl doctor` as a check command: its table and summary line, usage errors, and a URL that is not a router."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from kvctl.exit_codes import CheckStatus
from kvctl.mock.engine import EngineConfig
from kvctl.mock.fleet import Fleet
from tests.commands.live_router import free_port_url, kvctl, loaded_router
from tests.doctor.rig import doctor


def test_the_table_has_one_row_per_finding_and_the_summary_goes_to_stderr(tmp_path: Path) -> None:
    with loaded_router(tmp_path) as client:
        table = kvctl(client, "doctor")
        _, report = doctor(str(client.base_url).rstrip("/"))
    header, *lines = table.stdout.splitlines()
    rows = [line for line in lines if not line.startswith(" ")]  # a row's wrapped cells continue indented
    assert header.split() == ["SEVERITY", "CHECK", "CAUSE", "NEXT"]
    assert [row.split()[:2] for row in rows] == [[f["severity"], f["check"]] for f in report["findings"]]
    counts = {s: sum(f["severity"] == s for f in report["findings"]) for s in ("CRITICAL", "WARNING", "OK")}
    assert re.fullmatch(rf"doctor: {CheckStatus(table.exit_code).name} \(.*\)\n", table.stderr)
    assert f"{counts['OK']} ok" in table.stderr and report["status"] == CheckStatus(table.exit_code).name


@pytest.mark.parametrize("columns", [80, 120])
def test_rows_wrap_to_the_terminal_and_json_keeps_every_word(tmp_path: Path, columns: int) -> None:
    with loaded_router(tmp_path) as client:
        # a peer not there: a finding with a long cause (the URL twice, the error) and next step
        peer = ("--peer", free_port_url())
        report = kvctl(client, "doctor", *peer, "-o", "json")
        table = kvctl(client, "doctor", *peer, "-o", "wide", env={"COLUMNS": str(columns)})
    assert table.exit_code == report.exit_code == 1, table.output
    report = json.loads(report.stdout)
    assert max(len(line) for line in table.stdout.splitlines()) <= columns
    longest = max(len(f["cause"]) + len(f["next_step"]) for f in report["findings"])
    assert longest > columns  # what the table had to wrap: the JSON holds it whole
    words = table.stdout.split()
    for finding in report["findings"]:
        assert finding["check"] in words and all(
            word in table.stdout for word in finding["cause"].split() if len(word) < columns // 8)


@pytest.mark.parametrize("args", [
    ["--silent-after", "-1"],
    ["--divergence", "2"],
    ["--window", "soon", "--prometheus", "http://127.0.0.1:1"],
    ["--prometheus", "http://127.0.0.1:1", "--metrics", "http://127.0.0.1:1"],
])
def test_a_bad_option_is_unknown_before_anything_is_asked(args: list[str]) -> None:
    """A check that cannot run is UNKNOWN (3): its usage error's exit 2 read as CRITICAL to Nagios, paging for a
    typo. With -o nagios its status line says so on stdout, where the monitoring system reads it."""
    result = kvctl(free_port_url(), "doctor", *args)  # nothing listens there: usage is checked first
    assert result.exit_code == 3 and result.stdout == "", result.output
    assert result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1, result.stderr
    result = kvctl(free_port_url(), "doctor", *args, "-o", "nagios")
    assert result.exit_code == 3 and result.stdout.startswith("KVCTL DOCTOR UNKNOWN - error: "), result.output
    assert len(result.stdout.splitlines()) == 1, result.stdout


def test_a_server_without_a_scheme_is_unknown_not_critical() -> None:
    result = kvctl(free_port_url().removeprefix("http://"), "doctor", "-o", "nagios")
    assert result.exit_code == 3, result.output
    assert result.stdout.startswith("KVCTL DOCTOR UNKNOWN - error: --server '127.0.0.1:"), result.stdout


async def test_a_url_that_is_not_a_router_is_unknown() -> None:
    async with Fleet([EngineConfig(worker_id=1)]) as fleet:  # a mock engine's HTTP API: no /v1/status
        code, report = await asyncio.to_thread(doctor, fleet.engines[0].url)
    [finding] = report["findings"]
    assert code == 3 and finding["check"] == "router" and finding["severity"] == "UNKNOWN"
    assert finding["evidence"]["http_status"] == 404
