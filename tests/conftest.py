"""Shared fixtures: the real third-party fixtures folder, and an environment free of KVCTL_* settings."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.fixtures_path import FIXTURES

__all__ = ["FIXTURES"]


@pytest.fixture(autouse=True)
def _clean_kvctl_env() -> Iterator[None]:
    saved = {k: v for k, v in os.environ.items() if k.startswith("KVCTL_")}
    for key in saved:
        del os.environ[key]
    yield
    os.environ.update(saved)
