"""The `kvctl top` app: polls a source every interval in one exclusive worker and shows each frame.

A failed poll keeps the last frame on screen, marked stale, and says so once; the next good poll makes it
live again. Read-only unless started with `admin`: only then does `r` (after a confirmation) reset a worker.
"""

from __future__ import annotations

import asyncio

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import Footer, HelpPanel, Input

from kvctl.core.names import DEFAULT_MODEL
from kvctl.errors import KvctlError
from kvctl.tui.frame import SORTS, Frame, FrameBuilder, WorkerRow, arrange, next_sort
from kvctl.tui.screens import ConfirmReset, PrefixTree, WorkerDetail
from kvctl.tui.sources import EndOfRecording, Source
from kvctl.tui.widgets import AuditLine, HeaderBar, HealthPanel, RatesPanel, TiersPanel, WorkersTable

LIVE, PAUSED, STALE, ENDED, WAITING = "● live", "‖ paused", "✕ stale", "■ end of recording", "… waiting"
_STATE_STYLES = {LIVE: "bold green", PAUSED: "bold yellow", STALE: "bold red", ENDED: "bold blue", WAITING: "dim"}


class TopApp(App[None]):
    CSS = """
    #panels { height: 8; }
    #panels > * { height: 100%; width: 1fr; }
    #panels > TiersPanel { width: 36; }
    #filter { display: none; dock: bottom; margin-bottom: 1; }
    """
    TITLE = "kvctl top"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        # Textual's Ctrl-C only says "press ctrl+q" (and copies in the filter box): every terminal tool quits on it
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True),
        Binding("p", "pause", "Pause"),
        Binding("s", "cycle_sort", "Sort"),
        Binding("slash", "filter", "Filter"),
        Binding("t", "tree", "Tree"),
        Binding("question_mark", "help", "Help"),
        Binding("r", "reset", "Reset worker"),
        Binding("escape", "clear_filter", "Clear filter", show=False),
    ]

    def __init__(self, source: Source, *, interval: float = 1.0, admin: bool = False,
                 iterations: int | None = None) -> None:
        """`iterations`: exit after that many polls (one interval after the last); None: until `q`."""
        super().__init__()
        self.source = source
        self.interval = interval
        self.admin = admin
        self.iterations = iterations
        self.builder = FrameBuilder(source.label)
        self.frame: Frame | None = None
        self.sort = SORTS[0]
        self.filter_text = ""
        self.paused = False
        self.stale: str | None = None  # why the last poll failed, while it keeps failing
        self.ended = False

    def compose(self) -> ComposeResult:
        yield HeaderBar(id="header")
        with Horizontal(id="panels"):
            yield RatesPanel(id="rates")
            yield HealthPanel(id="health")
            yield TiersPanel(id="tiers")
        yield AuditLine(id="audit")
        yield WorkersTable(id="workers")
        yield Input(placeholder="filter: worker, model or mark (enter keeps it, esc clears)", id="filter")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(TiersPanel).display = False
        self.query_one(AuditLine).display = False
        self._show_state()
        self.query_one(WorkersTable).focus()
        self.poll_loop()

    async def on_unmount(self) -> None:
        await self.source.aclose()

    # ----- polling ----------------------------------------------------------------------------------------

    @work(exclusive=True, group="poll")
    async def poll_loop(self) -> None:
        polls = 0
        while not self.ended:
            if not self.paused:
                await self.refresh_frame()
                polls += 1
            await asyncio.sleep(self.interval)
            if self.iterations is not None and polls >= self.iterations:
                self.exit()
                return

    async def refresh_frame(self) -> None:
        """One poll: a new frame, or the last one marked stale (told once per outage), or the end of a replay."""
        try:
            poll = await self.source.poll()
            if not self.is_running:  # the app closed while the poll was out: its widgets are gone
                return
        except EndOfRecording:
            self.ended = True
            self.notify("end of the recording: the last frame stays", title="replay")
        except (KvctlError, ValueError) as exc:
            message = exc.message if isinstance(exc, KvctlError) else f"a malformed answer: {exc}"
            if self.stale is None:
                self.notify(f"{message}; showing the last frame", title="router unreachable", severity="error")
            self.stale = message
        else:
            if self.stale is not None:
                self.notify(f"{self.source.label} answers again", title="router back")
            self.stale = None
            self.show_frame(self.builder.update(poll))
        self._show_state()

    def show_frame(self, frame: Frame) -> None:
        self.frame = frame
        self.query_one(RatesPanel).show(frame)
        self.query_one(HealthPanel).show(frame.health)
        self.query_one(TiersPanel).show(frame.tiers, frame.tiers_error, frame.tiers_note)
        self.query_one(AuditLine).show(frame.audit, frame.audit_note)
        self._show_rows()

    def _show_state(self) -> None:
        state = (ENDED if self.ended else STALE if self.stale is not None else PAUSED if self.paused
                 else WAITING if self.frame is None else LIVE)
        shown = f"{state}: {self.stale}" if state == STALE else state
        self.query_one(HeaderBar).show(self.source.label, self.frame.header if self.frame else None, shown,
                                       _STATE_STYLES[state])

    def _show_rows(self) -> None:
        if self.frame is None:
            return
        rows = arrange(self.frame.workers, self.sort, self.filter_text)
        table = self.query_one(WorkersTable)
        table.show(rows)
        found = f" · filter “{self.filter_text}”" if self.filter_text else ""
        table.border_title = f"workers {len(rows)}/{len(self.frame.workers)} · sort: {self.sort.label}{found}"

    @property
    def shown_keys(self) -> list[str]:
        """The workers table's rows, top to bottom (what tests read)."""
        return self.query_one(WorkersTable).keys

    def selected_row(self) -> WorkerRow | None:
        key = self.query_one(WorkersTable).selected_key
        return next((w for w in self.frame.workers if w.key == key), None) if self.frame and key else None

    # ----- keys -------------------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """`r` exists only with --admin: read-only by default."""
        return self.admin if action == "reset" else True

    def action_pause(self) -> None:
        self.paused = not self.paused
        self._show_state()

    def action_cycle_sort(self) -> None:
        self.sort = next_sort(self.sort)
        self._show_rows()

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = True
        box.focus()

    def action_clear_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.value = ""
        self._close_filter()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value
        self._show_rows()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self._close_filter()

    def _close_filter(self) -> None:
        self.query_one("#filter", Input).display = False
        self.query_one(WorkersTable).focus()

    def on_workers_table_selected(self, event: WorkersTable.Selected) -> None:
        self.action_detail()

    def action_detail(self) -> None:
        row = self.selected_row()
        if row is not None:
            self.push_screen(WorkerDetail(row))

    def action_tree(self) -> None:
        row = self.selected_row()
        models = self.frame.header.models if self.frame else ()
        model = row.model if row is not None else (models[0] if models else DEFAULT_MODEL)
        self.push_screen(PrefixTree(self.source, model))

    def action_help(self) -> None:
        if self.screen.query(HelpPanel):
            self.action_hide_help_panel()
        else:
            self.action_show_help_panel()

    def action_reset(self) -> None:
        row = self.selected_row()
        if row is None:
            return

        def answered(yes: bool | None) -> None:
            if yes:
                self.reset_worker(row)

        self.push_screen(ConfirmReset(row, self.source.label), answered)

    @work(group="reset")
    async def reset_worker(self, row: WorkerRow) -> None:
        try:
            result = await self.source.reset(row.model, row.worker_id, row.dp_rank)
        except KvctlError as exc:
            hint = f" ({exc.hint})" if exc.hint else ""
            self.notify(exc.message + hint, title="reset failed", severity="error")
            return
        blocks = sum(c.blocks for c in result.cleared)
        self.notify(f"cleared {blocks:,} blocks of worker {row.key}", title="reset")
