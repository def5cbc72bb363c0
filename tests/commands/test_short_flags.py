"""Each short flag means one thing across the CLI: `-f` is a file wherever it exists, never a format elsewhere.
Walks the whole command tree, so a new command's short flag cannot reuse a letter for something else."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import typer
from typer.core import TyperArgument, TyperGroup

from kvctl.cli import app

ROOT: TyperGroup = typer.main.get_command(app)  # type: ignore[assignment]


def _options(command: Any, path: str) -> list[tuple[str, list[str], list[str]]]:
    """(command path, short names, long names) of every option of every command under `command`."""
    found = [(path, [o for o in opts if not o.startswith("--")], [o for o in opts if o.startswith("--")])
             for p in command.params if not isinstance(p, TyperArgument) for opts in [[*p.opts, *p.secondary_opts]]]
    if isinstance(command, TyperGroup):
        for name in command.commands:
            found += _options(command.commands[name], f"{path} {name}")
    return found


OPTIONS = _options(ROOT, "kvctl")


def test_each_short_flag_has_one_long_name_everywhere() -> None:
    meanings: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    meanings["-h"]["--help"].append("kvctl (every command)")
    for path, shorts, longs in OPTIONS:
        for short in shorts:
            meanings[short][" ".join(longs)].append(path)
    clashes = {short: dict(by_long) for short, by_long in meanings.items() if len(by_long) > 1}
    assert not clashes, clashes


def test_each_long_name_has_at_most_one_short_flag() -> None:
    letters: dict[str, set[str]] = defaultdict(set)
    for _, shorts, longs in OPTIONS:
        for long in longs:
            letters[long].update(shorts)
    assert not {long: s for long, s in letters.items() if len(s) > 1}


def test_a_long_name_with_a_short_flag_anywhere_has_it_everywhere() -> None:
    """`-m` on `route` but not on `mock load` is a flag that works in one command and fails in the next, the README
    promising both. Only long names that have a short flag somewhere count: a new long-only option is fine."""
    letters: dict[str, set[str]] = defaultdict(set)
    for _, shorts, longs in OPTIONS:
        for long in longs:
            letters[long].update(shorts)
    gaps = sorted(f"{path} {long} (elsewhere {', '.join(sorted(letters[long]))})"
                  for path, shorts, longs in OPTIONS for long in longs if letters[long] and not shorts)
    assert not gaps, gaps


def test_the_walk_sees_the_whole_tree() -> None:
    """The walk reaches nested groups' commands and their shared options (it cannot pass by finding nothing)."""
    paths = {path for path, _, _ in OPTIONS}
    assert {"kvctl", "kvctl events record", "kvctl tree dump", "kvctl mock load"} <= paths
    assert ("kvctl workers", ["-w"], ["--watch"]) in OPTIONS


def test_events_record_replay_and_publish_take_their_file_the_same_way() -> None:
    """`events record FILE`, then `events replay FILE`: a positional path in all three, never `-f` in one."""
    events: Any = ROOT.commands["events"]
    for name in ("record", "replay", "publish"):
        params = events.commands[name].params
        assert [type(p) for p in params].count(TyperArgument) == 1 and isinstance(params[0], TyperArgument), name
        assert not any("--file" in p.opts for p in params), name
