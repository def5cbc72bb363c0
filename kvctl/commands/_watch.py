"""`--watch` for read-only views: fetch and render again every interval until Ctrl-C.

In json mode each refresh is one JSON object on its own line (JSON lines a script can follow); in yaml
mode documents are separated by `---`; tables redraw in place on a terminal and follow each other
otherwise (a pipe or a log keeps every refresh).

A watch outlives its server: while the router (or Prometheus) cannot be reached, is restoring its index or does
not answer in time, the last view stays, stderr says since when, and the watch retries every interval until it
answers again. One watches a router exactly when it may go away.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Annotated, TypeVar

import typer

from kvctl.errors import KvctlError, TimedOut, UsageError
from kvctl.exit_codes import ExitCode
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
    outage = Outage(out, interval)
    shown = itertools.count()
    try:
        while True:
            try:
                data = fetch()
            except KvctlError as exc:
                if not passing(exc):
                    raise
                outage.failed(exc)
                time.sleep(interval)
                continue
            if redraw:
                out.stdout.write(_CLEAR)
            elif next(shown) and out.format in (OutputFormat.table, OutputFormat.wide):
                out.line("")
            if out.format is OutputFormat.yaml:
                out.line("---")
            render(data)
            outage.answered()  # after the view: a redraw would wipe it
            time.sleep(interval)
    except KeyboardInterrupt:
        return


def passing(exc: KvctlError) -> bool:
    """An error the next try may not meet: the server unreachable or restoring (exit 3), or too slow to answer."""
    return exc.exit_code == ExitCode.UNREACHABLE or isinstance(exc, TimedOut)


class Outage:
    """A watch's outage, said on stderr when it begins (again when its cause changes) and when it ends."""

    def __init__(self, out: Output, interval: float) -> None:
        self.out, self.interval = out, interval
        self.since: float | None = None
        self.said: str | None = None

    def failed(self, exc: KvctlError) -> None:
        if self.since is None:
            self.since = time.time()
        if exc.message != self.said:
            self.said = exc.message
            self.out.warn(f"unreachable since {_clock(self.since)}, retrying every {self.interval:g} s: {exc.message}")

    def answered(self) -> None:
        if self.since is not None:
            self.out.note(f"answering again at {_clock(time.time())}, after {time.time() - self.since:.0f} s "
                          f"unreachable (since {_clock(self.since)})")
            self.since = self.said = None


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))
