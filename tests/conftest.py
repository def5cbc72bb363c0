"""Shared fixtures: the real third-party fixtures folder, an environment free of KVCTL_* settings, each
implementation of kvctl's native functions in turn, and each path a route may take."""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from types import ModuleType

import pytest

from kvctl.core import _native_py, native
from tests.fixtures_path import FIXTURES
from tests.support.served import ROUTE_PATHS, route_on

__all__ = ["FIXTURES"]

# Not a setting under test but the implementation under test: `KVCTL_PURE_PYTHON=1 pytest` runs the suite,
# the routers it starts included, on the pure-Python twin of the C extension.
_KEPT = {"KVCTL_PURE_PYTHON"}


@pytest.fixture(autouse=True)
def _clean_kvctl_env() -> Iterator[None]:
    saved = {k: v for k, v in os.environ.items() if k.startswith("KVCTL_") and k not in _KEPT}
    for key in saved:
        del os.environ[key]
    yield
    os.environ.update(saved)


def implementation(name: str) -> ModuleType:
    """The module implementing kvctl's native functions: "C" (the extension; the test skips where this install
    did not build it) or "Python" (its twin)."""
    if name == "Python":
        return _native_py
    try:
        return importlib.import_module("kvctl.core._native")
    except ImportError:
        pytest.skip("the C extension is not built in this install (no compiler at install time)")


@pytest.fixture(scope="module", params=["C", "Python"])
def native_impl(request: pytest.FixtureRequest) -> Iterator[ModuleType]:
    """Runs a module's tests on each implementation (`pytestmark = pytest.mark.usefixtures("native_impl")`),
    so that the two cannot drift. Module-scoped, so that hypothesis's tests can use it."""
    module = implementation(request.param)
    with pytest.MonkeyPatch.context() as patch:
        for name in native.FUNCTIONS:
            patch.setattr(native, name, getattr(module, name))
        yield module


@pytest.fixture(params=ROUTE_PATHS)
def route_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test that routes on both paths a POST /v1/route may take (the fast path, the ASGI app): they must
    agree. An app in-process is served with `served(app, route_path)`; a `kvctl serve` started in the test
    takes the path from the environment."""
    route_on(monkeypatch, request.param)
    return str(request.param)


@pytest.fixture(scope="module", params=ROUTE_PATHS)
def module_route_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """`route_path` for a router shared by a module's tests."""
    with pytest.MonkeyPatch.context() as patch:
        route_on(patch, request.param)
        yield str(request.param)
