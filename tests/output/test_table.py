"""The plain table: alignment by terminal width, escaped control characters, nothing trailing."""

from __future__ import annotations

import io

from kvctl.output import Column, Output, OutputFormat, View
from kvctl.output.table import cell_width, render_table


def test_columns_align_by_terminal_width_and_lines_end_without_padding() -> None:
    text = render_table(["NAME", "BLOCKS"], [["a", "5"], ["模型", "12"]], ["left", "right"])
    assert text.splitlines() == [
        "NAME  BLOCKS",
        "a          5",
        "模型      12",
    ]


def test_wide_and_combining_characters_take_their_terminal_columns() -> None:
    assert cell_width("abc") == 3
    assert cell_width("模型") == 4
    assert cell_width("e\u0301") == 1


def test_control_characters_in_values_are_shown_escaped() -> None:
    text = render_table(["MODEL"], [["evil\x1b[2J\nname"]], ["left"])
    assert "\x1b" not in text and text.splitlines()[1] == "evil\\x1b[2J\\nname"


def test_title_goes_above_and_bold_only_when_asked() -> None:
    plain = render_table(["A"], [["1"]], ["left"], title="depths")
    assert plain == "depths\nA\n1\n"
    assert render_table(["A"], [["1"]], ["left"], bold_header=True).startswith("\x1b[1mA\x1b[0m\n")


def test_the_sink_draws_wide_only_columns_with_wide_and_never_styles_a_pipe() -> None:
    view = View(rows=lambda d: d, name_key="n", columns=[Column("n", "n"), Column("extra", "x", wide_only=True)])
    rows = [{"n": "w1", "x": None}]
    narrow, wide = io.StringIO(), io.StringIO()
    Output(OutputFormat.table, stdout=narrow).emit(rows, view)
    Output(OutputFormat.wide, stdout=wide).emit(rows, view)
    assert narrow.getvalue() == "N\nw1\n"
    assert wide.getvalue() == "N   EXTRA\nw1  -\n"
