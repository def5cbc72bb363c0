"""The screens over the dashboard: a worker's detail, the reset confirmation, the shared-prefix tree."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label, Static, Tree
from textual.widgets.tree import TreeNode

from kvctl.errors import KvctlError
from kvctl.tui.frame import WorkerRow
from kvctl.tui.prefixes import Prefix, describe
from kvctl.tui.sources import Source
from kvctl.tui.views import worker_cells

_CLOSE = [Binding("escape", "dismiss", "Close"), Binding("q", "dismiss", "Close", show=False)]


def _lines(title: str, fields: dict[str, Any]) -> Text:
    text = Text(title, "bold")
    for key, value in fields.items():
        text.append(f"\n  {key:<26}", "dim")
        text.append("-" if value is None else str(value))
    return text


class WorkerDetail(ModalScreen[None]):
    """Everything the router says about one worker: its /v1/workers row and its engine stream's row."""

    BINDINGS = [*_CLOSE, Binding("enter", "dismiss", "Close", show=False)]
    DEFAULT_CSS = """
    WorkerDetail { align: center middle; }
    #detail { width: 80; height: auto; max-height: 90%; border: thick $primary; background: $surface; padding: 1 2; }
    #detail Label { color: $text-muted; margin-top: 1; }
    """

    def __init__(self, row: WorkerRow) -> None:
        super().__init__()
        self.row = row

    def compose(self) -> ComposeResult:
        raw = {k: v for k, v in self.row.raw.items() if k != "stream"}
        stream = self.row.raw.get("stream")
        body = _lines(f"worker {self.row.key}", {**raw, "marks": worker_cells(self.row)["marks"]})
        if stream is not None:
            body.append("\n\n")
            body.append_text(_lines("engine stream", {k: v for k, v in stream.items() if k != "worker"}))
        with Vertical(id="detail"):
            yield Static(body)
            yield Label("esc: close")


class ConfirmReset(ModalScreen[bool]):
    """The one mutating key asks first, naming what it would clear and where."""

    BINDINGS = [Binding("y", "answer(True)", "Yes"), Binding("n", "answer(False)", "No"),
                Binding("escape", "answer(False)", "No", show=False)]
    DEFAULT_CSS = """
    ConfirmReset { align: center middle; }
    #confirm { width: 64; height: auto; border: thick $error; background: $surface; padding: 1 2; }
    #confirm-buttons { height: auto; margin-top: 1; align: center middle; }
    #confirm-buttons Button { margin: 0 2; }
    """

    def __init__(self, row: WorkerRow, router: str) -> None:
        super().__init__()
        self.row = row
        self.router = router

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm"):
            yield Static(f"Clear worker {self.row.key} ({self.row.blocks:,} blocks, model {self.row.model}) "
                        f"from the index of {self.router}?")
            with Horizontal(id="confirm-buttons"):
                yield Button("Reset (y)", variant="error", id="yes")
                yield Button("Cancel (n)", variant="primary", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class PrefixTree(ModalScreen[None]):
    """The prefixes most workers share in one model, fetched when opened (a dump can be large: on a thread)."""

    BINDINGS = [*_CLOSE, Binding("t", "dismiss", "Close", show=False)]
    DEFAULT_CSS = """
    PrefixTree { align: center middle; }
    #prefixes { width: 90%; height: 80%; border: thick $primary; background: $surface; padding: 0 1; }
    #prefix-tree { height: 1fr; }
    """

    def __init__(self, source: Source, model: str) -> None:
        super().__init__()
        self.source = source
        self.model = model

    def compose(self) -> ComposeResult:
        with Vertical(id="prefixes"):
            yield Label(f"shared prefixes of model {self.model}: loading…", id="prefixes-title")
            yield Tree[None]("device tier", id="prefix-tree")

    def on_mount(self) -> None:
        self.load()

    @work(exclusive=True, group="prefixes")
    async def load(self) -> None:
        title = self.query_one("#prefixes-title", Label)
        try:
            prefixes = await self.source.prefixes(self.model)
        except KvctlError as exc:
            title.update(Text(f"shared prefixes of model {self.model}: {exc.message}", "red"))
            return
        tree = self.query_one("#prefix-tree", Tree)
        _add(tree.root, prefixes, 0)
        tree.root.expand_all()
        title.update(f"shared prefixes of model {self.model}: most widely held first")
        tree.focus()


def _add(node: TreeNode[None], prefixes: tuple[Prefix, ...], more: int) -> None:
    for prefix in prefixes:
        child = node.add(describe(prefix))
        _add(child, prefix.children, prefix.more)
        if not prefix.children and not prefix.more:
            child.allow_expand = False
    if more:
        node.add_leaf(Text(f"… {more} more", "dim"))
