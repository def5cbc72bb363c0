"""A few screens as SVG snapshots (pytest-textual-snapshot): fixed terminal size, the fake source, no clock.

Every number on screen is a function of the poll count, and each test makes the same polls before the
screenshot; regenerate with `pytest tests/tui --snapshot-update` after a deliberate change, and look.

pytest-textual-snapshot 1.1 (the latest) pins syrupy 4.8, whose metadata says pytest < 9: it cannot be
in the `dev` extra next to pytest 9 (pip finds no resolution), so it is installed on its own with
`pip install --no-deps "pytest-textual-snapshot>=1.1,<1.2" "syrupy==4.8.0"` (it runs under pytest 9),
and these tests skip where it is not; `.ci/run` installs it and sets KVCTL_REQUIRE_SNAPSHOTS, so in CI a
missing plugin fails instead.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from textual.pilot import Pilot

from kvctl.tui.app import TopApp
from tests.tui.fake import PREFIXES, AuditState, FakeSource, fleet

if os.environ.get("KVCTL_REQUIRE_SNAPSHOTS"):
    import pytest_textual_snapshot  # noqa: F401
else:
    pytest.importorskip("pytest_textual_snapshot")

SIZE = (120, 36)
POLLS = 6  # enough history for the sparklines to show a shape


def dashboard(*, admin: bool = False, audit: AuditState = "figures") -> TopApp:
    return TopApp(FakeSource(fleet(24, tiers=True, audit=audit), prefixes=PREFIXES), interval=3600.0, admin=admin)


def after_polls(*keys: str) -> Callable[[Pilot[None]], Awaitable[None]]:
    async def run_before(pilot: Pilot[None]) -> None:
        await pilot.pause()
        app = pilot.app
        assert isinstance(app, TopApp)
        while app.source.polled < POLLS:  # type: ignore[attr-defined]
            await app.refresh_frame()
        await pilot.press(*keys)
        await pilot.pause()

    return run_before


def test_dashboard(snap_compare: Any) -> None:
    assert snap_compare(dashboard(), terminal_size=SIZE, run_before=after_polls())


@pytest.mark.parametrize("audit", ["empty", "missing"])
def test_audit_line_of_an_empty_window_and_of_a_router_without_the_audit(snap_compare: Any, audit: AuditState) -> None:
    """The dashboard's audit line (test_dashboard shows its figures) for an empty window and for a 404."""
    assert snap_compare(dashboard(audit=audit), terminal_size=SIZE, run_before=after_polls())


def test_sorted_by_blocks_and_filtered(snap_compare: Any) -> None:
    assert snap_compare(dashboard(), terminal_size=SIZE, run_before=after_polls("s", "slash", *"llama", "enter"))


def test_worker_detail(snap_compare: Any) -> None:
    assert snap_compare(dashboard(), terminal_size=SIZE, run_before=after_polls("down", "down", "down", "enter"))


def test_reset_confirmation(snap_compare: Any) -> None:
    assert snap_compare(dashboard(admin=True), terminal_size=SIZE, run_before=after_polls("down", "r"))


def test_shared_prefix_tree(snap_compare: Any) -> None:
    assert snap_compare(dashboard(), terminal_size=SIZE, run_before=after_polls("t"))
