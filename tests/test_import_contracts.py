"""docs/architecture.md's layering, checked rather than described: `lint-imports` runs the contracts of
pyproject.toml's `[tool.importlinter]` (core imports nothing else of kvctl, only the client and the server's
outgoing calls import httpx, the dashboard never loads the router, kvctl never imports its tests, only the index
reads its internals)."""

from __future__ import annotations

import pkgutil
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import kvctl

ROOT = Path(__file__).resolve().parents[1]
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # lint-imports colours its report whatever the output is


def test_the_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, _ANSI.sub("", done.stdout + done.stderr)


def test_core_contract_names_every_other_part_of_kvctl() -> None:
    """import-linter has no "anything but": a module added beside `core` must join the list, or core could import it."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    core = next(c for c in config["contracts"] if c["source_modules"] == ["kvctl.core"])
    parts = {f"kvctl.{m.name}" for m in pkgutil.iter_modules(kvctl.__path__)} - {"kvctl.core", "kvctl.__main__"}
    assert set(core["forbidden_modules"]) == parts
