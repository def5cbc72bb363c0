"""The committed shell completion scripts are what the CLI generates now."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl.cli import app

COMPLETIONS = Path(__file__).resolve().parents[1] / "completions"


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_script_is_fresh(shell: str) -> None:
    result = CliRunner().invoke(app, [], env={"_KVCTL_COMPLETE": f"source_{shell}"}, prog_name="kvctl")
    assert result.exit_code == 0
    assert result.stdout == (COMPLETIONS / f"kvctl.{shell}").read_text(), (
        f"regenerate: _KVCTL_COMPLETE=source_{shell} kvctl > completions/kvctl.{shell}")


def test_completion_answers_subcommands() -> None:
    env = {"_KVCTL_COMPLETE": "complete_bash", "COMP_WORDS": "kvctl ha", "COMP_CWORD": "1"}
    result = CliRunner().invoke(app, [], env=env, prog_name="kvctl")
    assert result.exit_code == 0
    assert "hash" in result.stdout.split()
