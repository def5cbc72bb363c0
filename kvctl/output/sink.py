"""The one output sink: data to stdout in the chosen format, everything else to stderr.

JSON and YAML print the API object itself (not the table's columns), an empty list prints `[]`,
a router's answer (a `kvctl.http_api` Struct) prints as the JSON the router sent, and its view reads that,
`-o name` prints one id per line (control characters escaped, as in a table: an id never adds a line).
Commands describe their table with a `View` and never print.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TextIO

import msgspec

from kvctl.output.table import printable, render_table, render_wrapped


class OutputFormat(StrEnum):
    table = "table"
    wide = "wide"
    json = "json"
    yaml = "yaml"
    name = "name"
    nagios = "nagios"  # the check commands' (doctor, tiers): a monitoring plugin's output, `kvctl.core.nagios`


Row = Mapping[str, Any]


@dataclass(frozen=True)
class Column:
    header: str
    key: str
    wide_only: bool = False
    justify: str = "left"


@dataclass(frozen=True)
class View:
    """How a data object shows as a table and as names; json/yaml ignore it."""

    rows: Callable[[Any], Iterable[Row]]
    columns: Sequence[Column]
    name_key: str
    title: str | None = None
    wrap: bool = False  # cells of prose (doctor's causes) wrap to the terminal's width rather than run past it


@dataclass
class Output:
    format: OutputFormat = OutputFormat.table
    color: bool = True
    stdout: TextIO = field(default_factory=lambda: sys.stdout)
    stderr: TextIO = field(default_factory=lambda: sys.stderr)

    def emit(self, data: Any, view: View) -> None:
        if isinstance(data, msgspec.Struct):
            data = msgspec.to_builtins(data)
        if self.format is OutputFormat.json:
            self._write(json.dumps(data, separators=(",", ":")) + "\n")
        elif self.format is OutputFormat.yaml:
            import yaml

            self._write(yaml.safe_dump(data, sort_keys=False))
        elif self.format is OutputFormat.name:
            self._write("".join(f"{printable(str(row[view.name_key]))}\n" for row in view.rows(data)))
        else:
            self._table(data, view, wide=self.format is OutputFormat.wide)

    def line(self, text: str) -> None:
        """One line of plain data (a URL, an id), in every format."""
        self._write(text + "\n")

    def note(self, message: str) -> None:
        """Progress and hints for the person watching: stderr, so stdout stays data."""
        self._err(message)

    def warn(self, message: str) -> None:
        self._err(f"warning: {message}")

    def error(self, message: str, hint: str | None = None) -> None:
        self._err(f"error: {message}" + (f" ({hint})" if hint else ""))

    def _table(self, data: Any, view: View, *, wide: bool) -> None:
        columns = [c for c in view.columns if wide or not c.wide_only]
        rows = [[_cell(row.get(c.key)) for c in columns] for row in view.rows(data)]
        bold = self.color and self.stdout.isatty()
        headers, justify = [c.header.upper() for c in columns], [c.justify for c in columns]
        if view.wrap:
            import shutil

            width = shutil.get_terminal_size().columns
            self._write(render_wrapped(headers, rows, justify, width=width, title=view.title, bold_header=bold))
        else:
            self._write(render_table(headers, rows, justify, title=view.title, bold_header=bold))

    def _write(self, text: str) -> None:
        self.stdout.write(text)
        self.stdout.flush()

    def _err(self, text: str) -> None:
        self.stderr.write(text + "\n")
        self.stderr.flush()


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)
