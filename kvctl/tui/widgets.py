"""The dashboard's panels. Each is told a frame (or part of one) and draws it; none fetches anything."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Group
from rich.segment import Segment
from rich.style import Style
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.events import Click
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Label, Sparkline, Static

from kvctl.tui.frame import Frame, Header, Mark, RoutingAudit, StreamHealth, WorkerRow
from kvctl.tui.poll import TierRate
from kvctl.tui.views import (
    WORKER_COLUMNS,
    audit_is_poor,
    audit_parts,
    header_fields,
    health_fields,
    per_second,
    percent,
    worker_cells,
)

MARK_STYLES = {Mark.gapped: "bold red", Mark.silent: "magenta", Mark.busy: "yellow"}
"""A row takes the style of its first mark in this order: a gapped index is worse than a silent engine,
which is worse than a busy one."""


def row_style(row: WorkerRow) -> str:
    return next((style for mark, style in MARK_STYLES.items() if mark in row.marks), "")


class HeaderBar(Static):
    """The router, its connection state and its totals: what someone glancing at the screen reads first."""

    DEFAULT_CSS = """
    HeaderBar { height: 2; padding: 0 1; background: $panel; }
    """

    def show(self, router: str, header: Header | None, state: str, state_style: str) -> None:
        first = Text.assemble(("kvctl top ", "bold"), (router, "bold cyan"), "  ", (state, state_style))
        second = Text()
        if header is not None:
            fields = header_fields(router, header)
            first.append_text(self._join({k: fields[k] for k in ("models", "uptime")}, lead=True))
            second = self._join({k: v for k, v in fields.items() if k not in ("router", "models", "uptime")})
        self.update(Text("\n").join((first, second)))

    @staticmethod
    def _join(fields: dict[str, str], *, lead: bool = False) -> Text:
        parts = [Text.assemble((f"{k} ", "dim"), v) for k, v in fields.items()]
        return Text("  ·  ").join([Text(), *parts] if lead else parts)


class RatesPanel(Vertical):
    """Sparklines of events/s, routes/s and the predicted hit rate over the last polls."""

    BORDER_TITLE = "rates"
    DEFAULT_CSS = """
    RatesPanel { border: round $primary; padding: 0 1; }
    RatesPanel Sparkline { height: 1; }
    RatesPanel Label { color: $text-muted; }
    """

    SERIES = (("events_per_s", "events/s", per_second), ("routes_per_s", "routes/s", per_second),
              ("predicted_hit_rate", "predicted hit", percent))

    def compose(self) -> ComposeResult:
        for name, _, _ in self.SERIES:
            yield Label(id=f"{name}-label")
            yield Sparkline([], id=f"{name}-line")

    def show(self, frame: Frame) -> None:
        for name, title, shown in self.SERIES:
            values = frame.history[name]
            self.query_one(f"#{name}-label", Label).update(f"{title} {shown(values[-1] if values else None)}")
            self.query_one(f"#{name}-line", Sparkline).data = list(values)


class HealthPanel(Static):
    """Are events arriving whole? Gaps, lost batches, failed replays, decode errors, queue drops."""

    BORDER_TITLE = "stream health"
    DEFAULT_CSS = """
    HealthPanel { border: round $primary; padding: 0 1; }
    """

    def show(self, health: StreamHealth) -> None:
        fields = health_fields(health)
        lines = [Text.assemble(("streams ", "dim"), fields.pop("streams"))]
        plane = fields.pop("event plane", None)
        grid = Table.grid(padding=(0, 1))
        for style in ("dim", "", "dim", ""):
            grid.add_column(style=style, no_wrap=True)
        cells = [(key, Text(value, "bold red" if value not in ("0", "-") else "")) for key, value in fields.items()]
        for left, right in zip(cells[::2], cells[1::2], strict=True):
            grid.add_row(*left, *right)
        if plane is not None:
            lines.append(Text.assemble(("event plane ", "dim"), plane))
        self.update(Group(lines[0], grid, *lines[1:]))


class TiersPanel(Static):
    """Hit rates per tier and instance, when `kvctl top` was given a Prometheus or `/metrics` endpoints."""

    BORDER_TITLE = "tiers"
    DEFAULT_CSS = """
    TiersPanel { width: 36; border: round $primary; padding: 0 1; }
    """

    def show(self, tiers: Sequence[TierRate] | None, error: str | None, note: str | None = None) -> None:
        self.display = tiers is not None
        if error:
            self.update(Text(error, "red"))
        elif not tiers and note is None:
            self.update(Text("collecting: rates need two scrapes", "dim"))
        else:
            lines = [Text.assemble((f"{t.tier:<7}", "bold"), f"{percent(t.hit_rate):>7}  ", (t.instance, "dim"))
                     for t in tiers or ()]
            self.update(Text("\n").join([*lines, *([Text(note, "dim italic")] if note else [])]))


class AuditLine(Widget):
    """Is KV-aware routing finding the cache? The router's decision audit of the last minutes in a line (`kvctl
    audit` for the rest), or two where the terminal is too narrow for one: the window's share, then the rest. Its
    share in red where doctor calls the routing poor; hidden where the poll had no audit to tell (a recording from
    before the audit line)."""

    DEFAULT_CSS = """
    AuditLine { height: auto; padding: 0 1; }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._audit: RoutingAudit | None = None
        self._note: str | None = None

    def show(self, audit: RoutingAudit | None, note: str | None) -> None:
        self._audit, self._note = audit, note
        self.display = audit is not None or note is not None
        self.refresh(layout=True)

    def render(self) -> Text:
        return self._text(self.content_size.width)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(self._text(width).wrap(self.app.console, max(1, width)))

    def _text(self, width: int) -> Text:
        audit = self._audit
        if audit is None:
            return Text.assemble(("routing audit: ", "bold"), (self._note or "", "dim"))
        (label, said), *rest = audit_parts(audit)
        first = Text.assemble((label, "bold"), (said, "bold red" if audit_is_poor(audit) else ""))
        if not rest:
            return first
        others = Text(" · ", "dim").join(Text.assemble((k, "dim"), v) for k, v in rest)
        one_line = first.cell_len + 3 + others.cell_len <= width
        return Text.assemble(first, Text(" · ", "dim") if one_line else "\n", others)


class WorkersTable(ScrollView, can_focus=True):
    """One row per (worker, dp rank), highlighted by its marks, with a row cursor.

    Drawn with Textual's line API: each visible line is one strip of pre-formatted cells, so a refresh
    costs the rows on screen, not the fleet. (A DataTable measures and renders every cell through Rich:
    with 256 workers that alone took longer than the 50 ms a refresh may take.)
    """

    BINDINGS = [
        Binding("enter", "select", "Detail"),
        Binding("up", "move(-1)", show=False),
        Binding("down", "move(1)", show=False),
        Binding("pageup", "move(-20)", show=False),
        Binding("pagedown", "move(20)", show=False),
        Binding("home", "move(-1_000_000)", show=False),
        Binding("end", "move(1_000_000)", show=False),
    ]
    COMPONENT_CLASSES = {"workers-table--header", "workers-table--cursor"}
    DEFAULT_CSS = """
    WorkersTable { height: 1fr; border: round $primary; }
    WorkersTable:focus { border: round $accent; }
    WorkersTable > .workers-table--header { text-style: bold; color: $text-accent; }
    WorkersTable > .workers-table--cursor { background: $accent 40%; }
    """

    class Selected(Message):
        """Enter (or a click) on a row."""

        def __init__(self, key: str) -> None:
            super().__init__()
            self.key = key

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cursor = 0
        self._rows: list[tuple[str, tuple[str, ...], Style]] = []
        self._widths = [len(c.header) for c in WORKER_COLUMNS]

    @property
    def keys(self) -> list[str]:
        return [key for key, _, _ in self._rows]

    @property
    def selected_key(self) -> str | None:
        return self._rows[self.cursor][0] if self._rows else None

    def show(self, rows: Sequence[WorkerRow]) -> None:
        """New rows; the cursor stays on the worker it was on, wherever the sort put it."""
        selected = self.selected_key
        self._rows = [(row.key, tuple(worker_cells(row).values()), _STYLES[row_style(row)]) for row in rows]
        self._widths = [max([len(c.header)] + [len(cells[i]) for _, cells, _ in self._rows])
                        for i, c in enumerate(WORKER_COLUMNS)]
        keys = self.keys
        self.cursor = keys.index(selected) if selected in keys else min(self.cursor, max(0, len(keys) - 1))
        self.virtual_size = Size(sum(self._widths) + _GAP * len(self._widths), len(self._rows) + 1)
        self._follow_cursor()
        self.refresh()

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        if y == 0:
            cells, style = tuple(c.header for c in WORKER_COLUMNS), self.get_component_rich_style(
                "workers-table--header")
        else:
            index = scroll_y + y - 1
            if index >= len(self._rows):
                return Strip.blank(self.size.width, self.rich_style)
            _, cells, style = self._rows[index]
            style = self.rich_style + style
            if index == self.cursor and self.has_focus:
                style += self.get_component_rich_style("workers-table--cursor")
        text = "".join(" " * _GAP + (cell.rjust(width) if column.justify == "right" else cell.ljust(width))
                       for column, cell, width in zip(WORKER_COLUMNS, cells, self._widths, strict=True))
        strip = Strip([Segment(text, style)]).crop(scroll_x, scroll_x + self.size.width)
        return strip.extend_cell_length(self.size.width, style)

    def action_move(self, by: int) -> None:
        if self._rows:
            self.cursor = max(0, min(len(self._rows) - 1, self.cursor + by))
            self._follow_cursor()
            self.refresh()

    def action_select(self) -> None:
        if self._rows:
            self.post_message(self.Selected(self._rows[self.cursor][0]))

    def on_click(self, event: Click) -> None:
        index = self.scroll_offset.y + event.y - 1
        if event.y >= 1 and 0 <= index < len(self._rows):
            self.cursor = index
            self.refresh()
            if event.chain == 2:
                self.action_select()

    def on_focus(self) -> None:
        self.refresh()

    def on_blur(self) -> None:
        self.refresh()

    def _follow_cursor(self) -> None:
        """Scroll so the cursor's row is on screen (below the header line)."""
        visible = max(1, self.scrollable_content_region.height - 1)
        top = self.scroll_offset.y
        if self.cursor < top:
            self.scroll_to(y=self.cursor, animate=False)
        elif self.cursor >= top + visible:
            self.scroll_to(y=self.cursor - visible + 1, animate=False)


_GAP = 2
_STYLES = {style: Style.parse(style) if style else Style() for style in ("", *MARK_STYLES.values())}
