"""Every example a user can copy (each command's help and epilog, the shell blocks of the README and of docs/)
parses: the command path exists and every option is one that command takes, with global options before or after
the sub-command as kubectl and nats allow. Parsing only: nothing runs, so no router is needed."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.core import TyperGroup
from typer.exceptions import Exit

from kvctl.cli import app, hoist_global_options

ROOT: TyperGroup = typer.main.get_command(app)  # type: ignore[assignment]
ROOT_DIR = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT_DIR / "README.md", *sorted((ROOT_DIR / "docs").glob("*.md"))]
_KVCTL = re.compile(r"^(?:\$\s*)?(?:\S*/)?kvctl(\s.*)?$")
_FENCED = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
"""A fenced block and its language, matched whole, so that a block of another language (toml, text) is skipped
rather than its closing fence taken for the opening of the next."""


def _commands(group: TyperGroup, path: str) -> Iterator[tuple[str, Any]]:
    for name in group.commands:
        command = group.commands[name]
        yield f"{path} {name}", command
        if isinstance(command, TyperGroup):
            yield from _commands(command, f"{path} {name}")


def _invocations(text: str, shell: bool) -> Iterator[str]:
    """The kvctl calls in a text: each segment (split at pipes, `&&`, `;`, `&` and redirections) that runs kvctl,
    of every line of a shell block (`shell`), or of a help text's example lines (those that start with kvctl;
    prose that names kvctl is not a call)."""
    for line in text.splitlines():
        if not shell and not _KVCTL.match(line.strip()):
            continue
        for segment in re.split(r"\s*(?:\|\||\||&&|;|&|\d?>>?|<)\s*", line.strip()):
            m = _KVCTL.match(segment)
            if m:
                yield "kvctl" + (m.group(1) or "")


def _examples() -> list[tuple[str, str]]:
    found = []
    for path, command in _commands(ROOT, "kvctl"):
        for text in (command.help or "", command.epilog or ""):
            found += [(path, call) for call in _invocations(text, shell=False)]
    for document in DOCUMENTS:
        blocks = [text for lang, text in _FENCED.findall(document.read_text()) if lang in ("", "sh", "bash", "console")]
        name = document.relative_to(ROOT_DIR).as_posix()
        found += [(name, call) for block in blocks for call in _invocations(block, shell=True)]
    return sorted(set(found))


def parse(argv: list[str]) -> None:
    """Parse `kvctl ARGV` as the CLI would, down to the command that would run; raises click's UsageError."""
    argv = hoist_global_options(ROOT, argv)
    command: Any = ROOT
    name, parent = "kvctl", None
    while True:
        try:
            ctx = command.make_context(name, argv, parent=parent)
        except Exit:  # --help, --version: an eager option ends the parse successfully
            return
        if not isinstance(command, TyperGroup):
            return
        rest = [*ctx._protected_args, *ctx.args]  # noqa: SLF001 - what the group hands its sub-command
        if not rest:
            return
        name, command, argv = command.resolve_command(ctx, rest)
        parent = ctx


EXAMPLES = _examples()


def test_there_are_examples_from_help_readme_and_docs() -> None:
    sources = {source for source, _ in EXAMPLES}
    assert {"README.md", "docs/runbook.md", "docs/configuration.md"} <= sources and len(sources) > 10, sources


@pytest.mark.parametrize(("source", "call"), EXAMPLES, ids=[f"{s}: {c}"[:90] for s, c in EXAMPLES])
def test_every_example_parses(source: str, call: str) -> None:
    argv = shlex.split(call.split(" #")[0])[1:]
    parse(argv)


@pytest.mark.parametrize("argv", [
    ["doctor", "--server", "http://127.0.0.1:1", "--timeout", "1", "-o", "json"],
    ["top", "--server=http://127.0.0.1:1", "--once", "--no-color"],
    ["tree", "stats", "-s", "http://127.0.0.1:1", "--debug", "--token", "t", "--context", "prod"],
])
def test_global_options_go_before_the_sub_command(argv: list[str]) -> None:
    hoisted = hoist_global_options(ROOT, argv)
    command_at = next(i for i, token in enumerate(hoisted) if token in ("doctor", "top", "tree"))
    assert sorted(hoisted) == sorted(argv)
    assert all(t not in hoisted[command_at:] for t in ("--server", "-s", "--token", "--context", "--debug",
                                                       "--no-color", "--timeout"))
    assert not any(t.startswith("--server=") for t in hoisted[command_at:])
    parse(argv)


def test_a_sub_commands_own_option_of_a_global_name_stays_its_own() -> None:
    argv = ["config", "set", "--context", "prod", "--server", "http://r:7433"]
    assert hoist_global_options(ROOT, argv) == ["--server", "http://r:7433", "config", "set", "--context", "prod"]
    argv = ["mock", "load", "--server", "http://r:7433", "--", "--debug"]
    assert hoist_global_options(ROOT, argv) == argv  # mock load's own --server; nothing after `--` moves
