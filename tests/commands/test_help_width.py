"""Every command's --help at 80 columns names each of its options whole: a name cut to `--active-prefill-to…`
cannot be typed from the help that shows it."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup
from typer.testing import CliRunner

from kvctl.cli import app

ROOT: TyperGroup = typer.main.get_command(app)  # type: ignore[assignment]


def _commands(group: TyperGroup, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], TyperCommand]]:
    for name in group.commands:
        command = group.commands[name]
        yield (*path, name), command
        if isinstance(command, TyperGroup):
            yield from _commands(command, (*path, name))


COMMANDS = [((), ROOT), *_commands(ROOT, ())]


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=[" ".join(p) or "kvctl" for p, _ in COMMANDS])
def test_every_option_name_appears_whole_at_80_columns(path: tuple[str, ...], command: TyperCommand) -> None:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert result.exit_code == 0, result.output
    names = [opt for p in command.params if not isinstance(p, TyperArgument) and not p.hidden
             for opt in (*p.opts, *p.secondary_opts)]
    cut = [name for name in names if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", result.stdout)]
    assert cut == [], result.stdout
    assert "…" not in result.stdout
    prose = [line for line in result.stdout.splitlines() if not line.lstrip().startswith(("kvctl ", "-"))]
    assert max(map(len, prose)) <= 80  # only an example or an option's names (never cut) may be longer


@pytest.mark.parametrize("args", [[], ["tree"], ["events"]], ids=["kvctl", "kvctl tree", "kvctl events"])
def test_a_bare_group_prints_its_help_as_the_answer(args: list[str]) -> None:
    """`kvctl` alone asks for help: it goes to stdout with exit 0, not as `error: Usage: ...` (issue 37)."""
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0
    assert result.stdout.startswith(f"Usage: kvctl {' '.join(args)}".rstrip() + " [OPTIONS] COMMAND")
    assert "error" not in result.stderr
