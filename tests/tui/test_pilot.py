"""The dashboard's keys, driven through Textual's Pilot over the fake source.

The app polls once when it starts and then waits an hour, so each test steps the source itself
(`refresh_frame`) and every frame is known.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from textual.pilot import Pilot
from textual.widgets import HelpPanel, Input, Tree

from kvctl.tui.app import TopApp
from kvctl.tui.frame import SORTS, arrange
from kvctl.tui.prefixes import describe
from kvctl.tui.screens import ConfirmReset, PrefixTree, WorkerDetail
from kvctl.tui.sources import NO_AUDIT
from kvctl.tui.widgets import AuditLine, HeaderBar, WorkersTable
from tests.tui.fake import PREFIXES, AuditState, FakeSource, fleet

SIZE = (120, 36)


@asynccontextmanager
async def top(*, admin: bool = False, interval: float = 3600.0, workers: int = 16, audit: AuditState = "figures",
              size: tuple[int, int] = SIZE) -> AsyncIterator[tuple[TopApp, Pilot[None], FakeSource]]:
    source = FakeSource(fleet(workers, audit=audit), prefixes=PREFIXES)
    app = TopApp(source, interval=interval, admin=admin)
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        yield app, pilot, source


def header_text(app: TopApp) -> str:
    return str(app.query_one(HeaderBar).content)


def audit_text(app: TopApp) -> str:
    """The audit line as drawn: its lines' text, or "" while it is hidden."""
    line = app.query_one(AuditLine)
    return "\n".join(strip.text.strip() for strip in line.render_lines(line.region.reset_offset)) \
        if line.display else ""


async def test_first_poll_fills_the_table_and_the_header() -> None:
    async with top() as (app, _, source):
        assert source.polled == 1
        assert app.shown_keys == [f"{100 + i // 2}:{i % 2}" for i in range(16)]
        assert "● live" in header_text(app) and "http://fake-router:7433" in header_text(app)
        await app.refresh_frame()  # a second poll: now there are rates
        assert app.frame is not None and app.frame.header.events_per_s is not None
        assert "events/s" in header_text(app)


async def test_s_cycles_the_sort_and_the_table_follows() -> None:
    async with top() as (app, pilot, _):
        assert app.frame is not None
        for sort in (*SORTS[1:], SORTS[0]):
            await pilot.press("s")
            assert app.sort == sort
            assert app.shown_keys == [r.key for r in arrange(app.frame.workers, sort)]
            assert f"sort: {sort.label}" in str(app.query_one(WorkersTable).border_title)
        await pilot.press("s")
        await app.refresh_frame()  # new numbers: the order follows them, not the first frame's
        assert app.shown_keys == [r.key for r in arrange(app.frame.workers, SORTS[1])]


async def test_slash_filters_enter_keeps_the_filter_and_escape_clears_it() -> None:
    async with top() as (app, pilot, _):
        await pilot.press("slash", *"qwen")
        box = app.query_one("#filter", Input)
        assert box.has_focus and box.value == "qwen"  # the keys went to the box, not to the bindings
        assert app.shown_keys and all(k.split(":")[0] in {"101", "103", "105", "107"} for k in app.shown_keys)
        await pilot.press("enter")
        assert not box.display and app.query_one(WorkersTable).has_focus
        await app.refresh_frame()
        assert len(app.shown_keys) == 8
        await pilot.press("escape")
        assert len(app.shown_keys) == 16


async def test_enter_shows_the_selected_workers_detail() -> None:
    async with top() as (app, pilot, _):
        await pilot.press("down", "down", "enter")
        assert isinstance(app.screen, WorkerDetail)
        assert app.screen.row.key == app.shown_keys[2] == "101:0"
        await pilot.press("escape")
        assert not isinstance(app.screen, WorkerDetail)


async def test_p_pauses_polling_and_says_so() -> None:
    async with top(interval=0.02) as (app, pilot, source):
        await pilot.press("p")
        assert "paused" in header_text(app)
        frozen = source.polled
        await pilot.pause(0.2)
        assert source.polled == frozen
        await pilot.press("p")
        await pilot.pause(0.2)
        assert source.polled > frozen and "● live" in header_text(app)


async def test_r_is_not_there_without_admin() -> None:
    async with top() as (app, pilot, source):
        await pilot.press("r")
        await pilot.pause()
        assert not isinstance(app.screen, ConfirmReset)
        assert source.resets == []


async def test_r_with_admin_resets_the_selected_worker_only_once_confirmed() -> None:
    async with top(admin=True) as (app, pilot, source):
        await pilot.press("down", "r")
        assert isinstance(app.screen, ConfirmReset)
        await pilot.press("n")
        assert not isinstance(app.screen, ConfirmReset) and source.resets == []
        await pilot.press("r", "y")
        await pilot.pause()
        assert source.resets == [("llama", 100, 1)]


async def test_t_shows_the_shared_prefix_tree() -> None:
    async with top() as (app, pilot, _):
        await pilot.press("t")
        await pilot.pause()
        assert isinstance(app.screen, PrefixTree)
        tree = app.screen.query_one(Tree)
        assert [str(n.label) for n in tree.root.children] == [describe(p) for p in PREFIXES]
        assert [str(n.label) for n in tree.root.children[0].children] == [describe(p) for p in PREFIXES[0].children]
        assert str(tree.root.children[1].children[0].label) == "… 2 more"
        await pilot.press("escape")
        assert not isinstance(app.screen, PrefixTree)


async def test_question_mark_toggles_help() -> None:
    async with top() as (app, pilot, _):
        await pilot.press("question_mark")
        assert app.screen.query(HelpPanel)
        await pilot.press("question_mark")
        assert not app.screen.query(HelpPanel)


async def test_iterations_stop_the_app_after_that_many_polls() -> None:
    source = FakeSource(fleet(4))
    app = TopApp(source, interval=0.01, iterations=3)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.3)
    assert source.polled == 3 and app.return_code == 0


@pytest.mark.parametrize("keys", [["ctrl+c"], ["slash", "ctrl+c"]])
async def test_ctrl_c_quits_even_in_the_filter_box(keys: list[str]) -> None:
    """Textual's own Ctrl-C only says "press ctrl+q to quit" (and copies in an input box): at 3 a.m. Ctrl-C quits."""
    async with top() as (app, pilot, _):
        for key in keys:
            await pilot.press(key)
        await pilot.pause()
        assert not app.is_running


async def test_the_audit_line_shows_the_windows_figures_on_two_lines_or_one_where_they_fit() -> None:
    async with top() as (app, _, _):
        assert audit_text(app) == (
            "routing (5 min): 83% of 46 decisions with cache to find went to a worker holding the most\n"
            "avoidable prefill 7% (1,536 tokens) · kvctl agrees 100% (16 ties) · top reasons: load_balance 8")
    async with top(size=(200, 36)) as (app, _, _):
        assert audit_text(app) == ("routing (5 min): 83% of 46 decisions with cache to find went to a worker holding "
                                   "the most · avoidable prefill 7% (1,536 tokens) · kvctl agrees 100% (16 ties) · "
                                   "top reasons: load_balance 8")
        assert app.query_one(AuditLine).size.height == 1


async def test_the_audit_line_for_an_empty_window_a_router_without_it_and_a_recording_without_it() -> None:
    async with top(audit="empty") as (app, _, _):
        assert audit_text(app) == ("routing (5 min): no decision heard in the last 300 s (12 since start); kvctl "
                                   "audit says where it listens")
    async with top(audit="missing") as (app, _, _):
        assert audit_text(app) == f"routing audit: {NO_AUDIT}"
        assert NO_AUDIT == "not on this router (its kvctl serve is from before the decision audit)"
        assert "● live" in header_text(app) and len(app.shown_keys) == 16  # the rest of the frame is live
    async with top(audit="unpolled") as (app, _, _):
        assert audit_text(app) == "" and len(app.shown_keys) == 16


async def test_the_audit_line_stays_while_the_router_is_unreachable() -> None:
    async with top() as (app, _, source):
        shown = audit_text(app)
        source.down = True
        await app.refresh_frame()
        assert app.stale is not None and audit_text(app) == shown
