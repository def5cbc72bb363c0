"""`--watch` for read-only views: fetch and render again every interval until Ctrl-C.

In json mode each refresh is one JSON object on its own line (JSON lines a script can follow); in yaml
mode documents are separated by `---`; tables redraw in place on a terminal and follow each other
otherwise (a pipe or a log keeps every refresh).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Annotated, TypeVar

import typer

from kvctl.errors import UsageError
from kvctl.output import Output, OutputFormat

T = TypeVar("T")

WatchOpt = Annotated[bool, typer.Option("--watch", "-w", help="Refresh until Ctrl-C (-o json: one object a line).")]
IntervalOpt = Annotated[float, typer.Option("--interval", help="Seconds between refreshes with --watch.")]

_CLEAR = "\x1b[H\x1b[2J"


def show(out: Output, fetch: Callable[[], T], render: Callable[[T], None], *, watch: bool, interval: float) -> None:
    """Render `fetch()` once, or with `watch` every `interval` seconds until Ctrl-C (which exits 0)."""
    if not interval > 0:
        raise UsageError(f"--interval must be > 0 seconds, got {interval}")
    if not watch:
        render(fetch())
        return
    redraw = out.format in (OutputFormat.table, OutputFormat.wide) and out.stdout.isatty()
    try:
        for n in itertools.count():
            data = fetch()
            if redraw:
                out.stdout.write(_CLEAR)
            elif n and out.format in (OutputFormat.table, OutputFormat.wide):
                out.line("")
            if out.format is OutputFormat.yaml:
                out.line("---")
            render(data)
            time.sleep(interval)
    except KeyboardInterrupt:
        return
