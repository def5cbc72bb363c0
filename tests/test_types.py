"""mypy over the package, as pyproject.toml's `[tool.mypy]` sets it: strict on `core` and `client`, the rest
checked (bodies of unannotated functions included). The tests are not checked: they are typed for the reader."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_package_type_checks() -> None:
    # A cold run (a fresh venv's cache) takes ~30 s of CPU; later runs read the cache and take a few seconds.
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
