"""Each command's help says what it may change, by one rule: `(read-only)` when it changes nothing on a router,
an event plane or kvctl's config file; `(read-write…)` when it does (`: the config file` when only that);
`(read-only; read-write with --FLAG)` when one flag makes it change a router; `(daemon)` for the long-running
processes (a router, mock engines). The lists below are the state-changing commands, kept by hand."""

from __future__ import annotations

import re
from collections.abc import Iterator

import typer
from typer.core import TyperCommand, TyperGroup

from kvctl.cli import app

ROOT: TyperGroup = typer.main.get_command(app)  # type: ignore[assignment]

CHANGES_A_ROUTER = {"busy set", "router reset", "events replay", "events publish", "mock load"}
CHANGES_THE_CONFIG_FILE = {"config set", "config use-context"}
CHANGES_WITH = {"route": "--reserve", "top": "--admin"}
DAEMONS = {"serve", "mock"}
TAG = re.compile(r"\((read-only|read-write|read-write: the config file|daemon|read-only; read-write with --[\w-]+)\)$")


def _leaves(group: TyperGroup, path: str = "") -> Iterator[tuple[str, TyperCommand]]:
    """Every command that runs something: the leaves, and a group that runs without a sub-command (`mock`)."""
    for name in group.commands:
        command = group.commands[name]
        if not isinstance(command, TyperGroup):
            yield f"{path}{name}", command
            continue
        if command.invoke_without_command:
            yield f"{path}{name}", command
        yield from _leaves(command, f"{path}{name} ")


def expected(path: str) -> str:
    if path in CHANGES_A_ROUTER:
        return "(read-write)"
    if path in CHANGES_THE_CONFIG_FILE:
        return "(read-write: the config file)"
    if path in CHANGES_WITH:
        return f"(read-only; read-write with {CHANGES_WITH[path]})"
    return "(daemon)" if path in DAEMONS else "(read-only)"


def test_every_command_is_tagged_by_the_one_rule() -> None:
    leaves = dict(_leaves(ROOT))
    assert CHANGES_A_ROUTER | CHANGES_THE_CONFIG_FILE | CHANGES_WITH.keys() | DAEMONS <= leaves.keys()
    tags = {}
    for path, command in leaves.items():
        first = (command.help or "").split("\n\n")[0].strip()
        found = TAG.search(first)
        tags[path] = found.group(0) if found else f"no tag: {first[-40:]!r}"
    assert tags == {path: expected(path) for path in leaves}


def test_each_flag_named_in_a_tag_is_the_command_s() -> None:
    for path, flag in CHANGES_WITH.items():
        command = dict(_leaves(ROOT))[path]
        assert any(flag in p.opts for p in command.params), (path, flag)
