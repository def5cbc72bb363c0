"""A live progress line on stderr for commands that run a while (`mock load`, `events replay`).

Only for a person: stderr is a terminal and the output is a table. A pipe, a log or `-o json` gets
nothing but the result, so nothing has to be filtered out of what a script reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from kvctl.output.sink import Output, OutputFormat

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID


def shown_to_a_person(out: Output) -> bool:
    return out.format in (OutputFormat.table, OutputFormat.wide) and out.stderr.isatty()


class ProgressLine:
    """One Rich progress row per task: its description, a bar, done/total, `detail` (a `rich.progress`
    TextColumn template over the task's fields, e.g. "{task.fields[sent]} sent"), elapsed and remaining
    time. Where it is not shown (`shown_to_a_person`), adding and updating tasks do nothing."""

    def __init__(self, out: Output, detail: str) -> None:
        self._progress: Progress | None = None
        if shown_to_a_person(out):
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn(detail), TimeElapsedColumn(), TextColumn("left"),
                                      TimeRemainingColumn(), console=Console(file=out.stderr, no_color=not out.color))

    def __enter__(self) -> ProgressLine:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def task(self, description: str, total: int, **fields: Any) -> int:
        """A new row; its id for `update`."""
        return 0 if self._progress is None else self._progress.add_task(description, total=total, **fields)

    def update(self, task: int, completed: int, **fields: Any) -> None:
        if self._progress is not None:
            self._progress.update(cast("TaskID", task), completed=completed, **fields)  # an id `task` gave
