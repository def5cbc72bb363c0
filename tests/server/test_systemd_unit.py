"""contrib/systemd/kvctl.service: systemd accepts it, and it asks of `kvctl serve` only what serve does."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from typer.main import get_command

from kvctl.cli import app

UNIT = Path(__file__).resolve().parents[2] / "contrib" / "systemd" / "kvctl.service"


def directives(text: str) -> dict[str, dict[str, list[str]]]:
    """Section -> key -> its values in order (systemd keys repeat, so configparser will not do)."""
    sections: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        sections[section][key].append(value)
    return sections


def seconds(value: str) -> float:
    """A systemd time span of the forms the unit uses: `60s`, `5min`, `90`."""
    number, unit = re.fullmatch(r"(\d+)(s|min)?", value).groups()  # type: ignore[union-attr]
    return int(number) * (60 if unit == "min" else 1)


def test_the_unit_is_hardened_and_notifies() -> None:
    service = directives(UNIT.read_text())["Service"]
    expected = {"Type": "notify", "DynamicUser": "yes", "StateDirectory": "kvctl", "ProtectSystem": "strict",
                "ProtectHome": "yes", "PrivateTmp": "yes", "NoNewPrivileges": "yes", "Restart": "on-failure",
                "CapabilityBoundingSet": "", "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
                "SystemCallFilter": "@system-service"}
    assert {key: service[key][-1] for key in expected if key in service} == expected
    assert int(service["LimitNOFILE"][0]) >= 4096
    assert seconds(service["WatchdogSec"][0]) > 0


def test_exec_start_uses_serve_flags_that_exist_and_stop_waits_longer_than_the_drain() -> None:
    service = directives(UNIT.read_text())["Service"]
    argv = shlex.split(service["ExecStart"][0])
    assert argv[:2] == ["/usr/local/bin/kvctl", "serve"]
    serve = get_command(app).commands["serve"]  # type: ignore[attr-defined]
    known = {opt for param in serve.params for opt in param.opts}
    given = [arg for arg in argv[2:] if arg.startswith("--")]
    assert given and set(given) <= known
    assert argv[argv.index("--state-dir") + 1] == "${STATE_DIRECTORY}"
    drain = float(argv[argv.index("--shutdown-timeout") + 1])
    assert seconds(service["TimeoutStopSec"][0]) >= drain + 10  # the state log is fsynced after the drain


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian package `systemd`): the unit was not verified")
    # verify checks that ExecStart's program exists: point it at this environment's kvctl
    kvctl = Path(sys.executable).with_name("kvctl")
    assert kvctl.exists(), kvctl
    unit = tmp_path / "kvctl.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/kvctl", str(kvctl)))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stderr == "", result.stderr
