"""`kvctl doctor -o nagios`: a monitoring plugin's output (Nagios, Icinga, NRPE) from a real router, and the format
itself. The table's header used to be the alert's text, the verdict being on stderr, which NRPE drops."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvctl.core.nagios import Perf, plugin_output
from tests.commands.live_router import free_port_url, kvctl, loaded_router

STATUS_LINE = re.compile(r"KVCTL DOCTOR (OK|WARNING|CRITICAL|UNKNOWN) - [^|\n]+ \| "
                         r"'critical'=\d+;;;0 'warning'=\d+;;;0 'unknown'=\d+;;;0 'ok'=\d+;;;0 "
                         r"'workers'=4;;;0 'silent_workers'=\d;;;0;4 'loop_held'=[\d.]+%;0.5;;0;100")


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """A router holding Dynamo's fixture dump: 4 workers that sent events once and serve nothing."""
    with loaded_router(Path(tmp_path_factory.mktemp("router"))) as client:
        yield client


def test_an_idle_fleet_is_ok_and_the_status_line_comes_first(router: httpx.Client) -> None:
    result = kvctl(router, "doctor", "--silent-after", "0", "-o", "nagios")
    first, *details = result.stdout.splitlines()
    assert STATUS_LINE.fullmatch(first), first
    assert result.exit_code == ["OK", "WARNING", "CRITICAL", "UNKNOWN"].index(first.split()[2]), result.output
    assert "'silent_workers'=4;" in first  # all silent, none serving: idle, not a page
    assert [line for line in details if line.startswith("OK silent: 4 of 4 workers silent")], details
    assert result.stderr == ""


def test_the_worst_finding_is_the_alert_and_its_next_step_the_next_line(router: httpx.Client) -> None:
    peer = free_port_url()
    result = kvctl(router, "doctor", "--peer", peer, "-o", "nagios")
    first, step, *_ = result.stdout.splitlines()
    assert result.exit_code == 1, result.output
    assert first.startswith(f"KVCTL DOCTOR WARNING - peer {peer} not compared: cannot reach the router at {peer}")
    assert step == f"next: curl {peer}/v1/status"


def test_nagios_checks_once() -> None:
    result = kvctl(free_port_url(), "doctor", "--watch", "-o", "nagios")
    assert result.exit_code == 3 and result.stdout.startswith("KVCTL DOCTOR UNKNOWN - error: -o nagios checks once")


def test_the_plugin_format_keeps_one_alert_line_and_parseable_perfdata() -> None:
    text = plugin_output("tiers", "WARNING", "a | b\nc", [Perf("it's=x", 1e-5, "%", warn=0.5, min=0, max=1),
                                                         Perf("n", 2_000_000.0)], ["one", "two\nthree"])
    assert text.splitlines() == ["KVCTL TIERS WARNING - a / b c | 'it''s_x'=0.00001%;0.5;;0;1 'n'=2000000",
                                 "one", "two three"]
