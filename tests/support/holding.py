"""`holding`: a hold of tests/support/hold/sitecustomize.py in every kvctl process a test starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HOLD_DIR = Path(__file__).parent / "hold"


def holding(patch: pytest.MonkeyPatch, hold: str, gate: Path) -> Path:
    """Processes started from here on hold at `hold` (RESTORE or FOLD) until `gate` exists; the gate to create."""
    path = os.environ.get("PYTHONPATH")
    patch.setenv("PYTHONPATH", os.pathsep.join([str(HOLD_DIR), *([path] if path else [])]))
    patch.setenv(f"KVCTL_TEST_HOLD_{hold}", str(gate))
    return gate
