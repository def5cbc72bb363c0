"""Aligned columns without borders, as kubectl prints them: what a person scans and what awk splits.

Drawn here rather than with rich because importing rich's console costs ~35 ms, a tenth of a quick
command's budget, for a table that needs nothing but widths. A table of prose, whose rows would run to
hundreds of columns, is wrapped to the terminal by rich (`render_wrapped`).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence

GAP = "  "
_BOLD, _RESET = "\x1b[1m", "\x1b[0m"


def cell_width(text: str) -> int:
    """Terminal columns: wide East Asian characters take two, combining marks none."""
    if text.isascii():
        return len(text)
    return sum(0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1
               for ch in text)


def printable(text: str) -> str:
    """Control characters shown escaped: a value from a router or an engine (a model name, an endpoint)
    must not move the cursor, recolour the terminal or add lines to a table."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]], justify: Sequence[str], *,
                 title: str | None = None, bold_header: bool = False) -> str:
    """The table as text, one line per row after the header; `justify` is "left" or "right" per column."""
    rows = [[printable(cell) for cell in row] for row in rows]
    widths = [max([cell_width(h)] + [cell_width(row[i]) for row in rows]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        padded = [_pad(cell, width, how) for cell, width, how in zip(cells, widths, justify, strict=True)]
        return GAP.join(padded).rstrip()

    header = line(headers)
    lines = [title] if title else []
    lines.append(f"{_BOLD}{header}{_RESET}" if bold_header else header)
    lines.extend(line(row) for row in rows)
    return "\n".join(lines) + "\n"


def _pad(cell: str, width: int, how: str) -> str:
    fill = " " * (width - cell_width(cell))
    return fill + cell if how == "right" else cell + fill


def render_wrapped(headers: Sequence[str], rows: Sequence[Sequence[str]], justify: Sequence[str], *, width: int,
                   title: str | None = None, bold_header: bool = False) -> str:
    """The same table with each cell wrapped to fit `width` columns in all (a long word is folded)."""
    from io import StringIO

    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, padding=(0, len(GAP), 0, 0), pad_edge=False, show_edge=False,
                  header_style="bold" if bold_header else "", title=title, title_justify="left",
                  title_style="")
    for header, how in zip(headers, justify, strict=True):
        table.add_column(header, justify=how, overflow="fold")  # type: ignore[arg-type]
    for row in rows:
        table.add_row(*(Text(printable(cell)) for cell in row))  # Text: a `[` in a value is not markup
    buffer = StringIO()
    Console(file=buffer, width=width, force_terminal=bold_header, no_color=not bold_header, highlight=False,
            emoji=False, markup=False).print(table)
    return "".join(line.rstrip() + "\n" for line in buffer.getvalue().splitlines())
