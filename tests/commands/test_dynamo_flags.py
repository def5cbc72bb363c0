"""`kvctl serve` takes a Dynamo 1.6.1 frontend's router flags (issue 38): each one in the frontend's own `--help`
(captured) is kvctl's under its own name or another, already what kvctl does, or refused by name with why."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from kvctl.cli import app
from kvctl.commands._dynamo_flags import FLAGS, translate
from kvctl.errors import UsageError
from tests.fixtures_path import FIXTURES

HELP = (FIXTURES / "dynamo-1.6.1-fleet" / "cli" / "frontend-help.txt").read_text()


def _router_flags() -> set[str]:
    """Every flag name of the help's "Router Options" and "KV Router Options" sections (an option's line starts
    with two spaces and its names, before its description's column)."""
    sections = re.findall(r"^(?:KV )?Router Options:\n(.*?)(?=^\S)", HELP, re.M | re.S)
    assert len(sections) == 2
    heads = [line.strip().split("  ")[0] for text in sections for line in text.splitlines()
             if line.startswith("  --")]
    return {name for head in heads for name in re.findall(r"--[a-z0-9-]+", head)}


def _serve_options() -> set[str]:
    from typer.main import get_command

    command = get_command(app).get_command(None, "serve")  # type: ignore[attr-defined]
    return {name for param in command.params for name in (*param.opts, *param.secondary_opts)}


def test_every_router_flag_of_the_frontend_is_taken_or_refused_by_name() -> None:
    flags = _router_flags()
    assert len(flags) > 40 and "--router-queue-threshold" in flags and "--no-kv-events" in flags
    unknown = sorted(flags - _serve_options() - set(FLAGS))
    assert unknown == [], f"Dynamo flags kvctl serve would answer 'No such option' to: {unknown}"
    assert not set(FLAGS) & _serve_options(), "a flag kvctl serve takes itself is in the table too"


@pytest.mark.parametrize("name", sorted(FLAGS))
def test_each_flag_is_renamed_dropped_or_refused_with_its_reason(name: str) -> None:
    flag = FLAGS[name]
    value = next(iter(flag.same), "x") if isinstance(flag.same, frozenset) else "7"
    argv = [name, value] if flag.value else [name]
    if flag.kvctl is not None:
        assert translate(argv) == [flag.kvctl, *argv[1:]]
        assert translate([f"{name}={value}"] if flag.value else argv) == [flag.kvctl, *argv[1:]]
    elif flag.same is True or isinstance(flag.same, frozenset):
        assert translate(["--listen", "127.0.0.1:0", *argv]) == ["--listen", "127.0.0.1:0"]
    if not flag.kvctl and flag.why:
        refused = [name, "not-a-value-kvctl-takes"] if flag.value else [name]
        with pytest.raises(UsageError) as caught:
            translate(refused)
        assert caught.value.message.startswith(f"{' '.join(refused)} (Dynamo's) is not taken by kvctl serve: ")
        assert flag.why in caught.value.message


def test_nothing_after_a_double_dash_is_read() -> None:
    assert translate(["--", "--router-queue-threshold", "0.5"]) == ["--", "--router-queue-threshold", "0.5"]


def test_a_refused_flag_is_one_line_and_exit_2() -> None:
    result = CliRunner().invoke(app, ["serve", "--router-predicted-ttl-secs", "5"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines()[0] == (
        "error: --router-predicted-ttl-secs 5 (Dynamo's) is not taken by kvctl serve: predicted-block TTLs are not "
        "implemented yet (issue 38)")
