"""The one output sink: each format of the same data, data on stdout and everything else on stderr, and no
value that can move the cursor or add a line in any format a person or a script reads."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
import yaml

from kvctl.output import Column, Output, OutputFormat, View

EVIL = "evil\x1b[2J\nname"
DATA = {"workers": [{"id": "1:0", "model": "default", "blocks": 12, "load": 0.25, "endpoint": None},
                    {"id": "2:1", "model": EVIL, "blocks": 3, "load": 1.0, "endpoint": "tcp://h:5557"}]}
VIEW = View(rows=lambda d: d["workers"], name_key="id", title=None,
            columns=[Column("worker", "id"), Column("model", "model"), Column("blocks", "blocks", justify="right"),
                     Column("load", "load", justify="right"), Column("endpoint", "endpoint", wide_only=True)])


def emit(fmt: OutputFormat, data: Any = DATA) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    Output(fmt, stdout=out, stderr=err).emit(data, VIEW)
    return out.getvalue(), err.getvalue()


def test_table_shows_the_view_columns_escaped_and_nothing_on_stderr() -> None:
    out, err = emit(OutputFormat.table)
    assert out.splitlines() == [
        "WORKER  MODEL              BLOCKS  LOAD",
        "1:0     default                12  0.25",
        "2:1     evil\\x1b[2J\\nname       3     1",
    ]
    assert err == ""


def test_wide_adds_the_wide_only_columns_and_shows_none_as_a_dash() -> None:
    out, _ = emit(OutputFormat.wide)
    assert out.splitlines()[0].split() == ["WORKER", "MODEL", "BLOCKS", "LOAD", "ENDPOINT"]
    assert out.splitlines()[1].split()[-1] == "-" and out.splitlines()[2].endswith("tcp://h:5557")


def test_json_is_the_api_object_on_one_line_with_control_characters_escaped() -> None:
    out, err = emit(OutputFormat.json)
    assert out.count("\n") == 1 and "\x1b" not in out
    assert json.loads(out) == DATA and err == ""


def test_yaml_is_the_api_object_with_control_characters_escaped() -> None:
    out, _ = emit(OutputFormat.yaml)
    assert "\x1b" not in out and yaml.safe_load(out) == DATA


def test_name_prints_one_id_a_line_and_an_id_cannot_add_a_line() -> None:
    assert emit(OutputFormat.name)[0] == "1:0\n2:1\n"
    view = View(rows=lambda d: d, name_key="model", columns=[Column("model", "model")])
    out = io.StringIO()
    Output(OutputFormat.name, stdout=out).emit([{"model": EVIL}], view)
    assert out.getvalue() == "evil\\x1b[2J\\nname\n"


@pytest.mark.parametrize("fmt", [OutputFormat.json, OutputFormat.yaml])
def test_an_empty_list_is_an_empty_list_not_nothing(fmt: OutputFormat) -> None:
    out, _ = emit(fmt, [])
    assert (json.loads(out) if fmt is OutputFormat.json else yaml.safe_load(out)) == []


@pytest.mark.parametrize("fmt", list(OutputFormat))
def test_notes_warnings_and_errors_go_to_stderr_so_stdout_stays_data(fmt: OutputFormat) -> None:
    out, err = io.StringIO(), io.StringIO()
    sink = Output(fmt, stdout=out, stderr=err)
    sink.note("listening on nats://127.0.0.1:4222")
    sink.warn("received nothing")
    sink.error("cannot reach http://r:8000", "is the router running?")
    sink.line("http://127.0.0.1:8000")
    assert out.getvalue() == "http://127.0.0.1:8000\n"
    assert err.getvalue().splitlines() == ["listening on nats://127.0.0.1:4222", "warning: received nothing",
                                           "error: cannot reach http://r:8000 (is the router running?)"]


def test_the_header_is_bold_only_on_a_terminal_with_colour() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    for color, bold in ((True, True), (False, False)):
        out = Tty()
        Output(OutputFormat.table, color=color, stdout=out).emit(DATA, VIEW)
        assert out.getvalue().startswith("\x1b[1m") is bold
