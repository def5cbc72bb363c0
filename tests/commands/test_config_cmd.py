"""`kvctl config show / use-context / set` through the CLI, with KVCTL_CONFIG pointing at a temporary file."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl.cli import app
from tests.commands.live_router import json_of, loaded_router, one_line_error

runner = CliRunner()


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "kvctl" / "config.toml"
    monkeypatch.setenv("KVCTL_CONFIG", str(path))
    return path


def _show(*args: str, env: dict[str, str] | None = None) -> dict:
    return json_of(runner.invoke(app, [*args, "config", "show", "--sources", "-o", "json"], env=env))


def test_precedence_flag_env_context_default(config: Path) -> None:
    config.parent.mkdir()
    config.write_text('current-context = "prod"\n[contexts.prod]\nserver = "http://prod:7433"\ntimeout = 9\n'
                      'token = "t0k"\n')
    shown = _show("--timeout", "3", env={"KVCTL_SERVER": "http://env:1"})
    assert shown["context"] == "prod" and shown["contexts"] == ["prod"] and shown["config_file"] == str(config)
    assert shown["settings"] == {"server": "http://env:1", "token": "***", "prometheus": None, "timeout": 3.0,
                                  "model": None}
    assert shown["sources"] == {"server": "env KVCTL_SERVER", "token": f"context prod ({config})",
                                "prometheus": "default", "timeout": "flag", "model": "default"}
    assert _show("--server", "http://flag:2", env={"KVCTL_SERVER": "http://env:1"})["sources"]["server"] == "flag"
    assert _show()["settings"]["server"] == "http://prod:7433"
    raw = json_of(runner.invoke(app, ["config", "show", "--show-token", "-o", "json"]))
    assert raw["settings"]["token"] == "t0k" and "sources" not in raw


def test_set_creates_contexts_and_use_context_switches(config: Path) -> None:
    one_line_error(runner.invoke(app, ["config", "set", "server", "http://a:1"]), 2, "--context NAME")
    first = runner.invoke(app, ["config", "set", "server", "http://lab:7433", "--context", "lab", "-o", "json"])
    assert json_of(first) == {"context": "lab", "key": "server", "value": "http://lab:7433",
                              "config_file": str(config)}
    assert "current context" in first.stderr  # the first context becomes the current one
    assert runner.invoke(app, ["config", "set", "timeout", "7", "--context", "prod"]).exit_code == 0
    assert runner.invoke(app, ["config", "set", "timeout", "2"]).exit_code == 0  # the current context: lab
    assert tomllib.loads(config.read_text()) == {
        "current-context": "lab", "contexts": {"lab": {"server": "http://lab:7433", "timeout": 2.0},
                                               "prod": {"timeout": 7.0}}}
    assert json_of(runner.invoke(app, ["config", "use-context", "prod", "-o", "json"]))["context"] == "prod"
    shown = _show()
    assert (shown["context"], shown["settings"]["timeout"], shown["settings"]["server"]) == (
        "prod", 7.0, "http://127.0.0.1:7433")
    assert _show("--context", "lab")["settings"]["timeout"] == 2.0
    one_line_error(runner.invoke(app, ["config", "use-context", "staging"]), 2, "known: lab, prod")


def test_dry_runs_of_set_and_use_context_show_the_edit_and_write_nothing(config: Path) -> None:
    dry = runner.invoke(app, ["config", "set", "server", "http://lab:7433", "--context", "lab", "--dry-run",
                              "-o", "json"])
    assert json_of(dry) == {"context": "lab", "key": "server", "value": "http://lab:7433",
                            "config_file": str(config), "dry_run": True}
    assert "lab would become the current context" in dry.stderr and "was not changed" in dry.stderr
    assert not config.exists()
    assert runner.invoke(app, ["config", "set", "server", "http://lab:7433", "--context", "lab"]).exit_code == 0
    assert runner.invoke(app, ["config", "set", "timeout", "3", "--context", "prod"]).exit_code == 0
    before = config.read_bytes()
    assert json_of(runner.invoke(app, ["config", "set", "timeout", "9", "--dry-run", "-o", "json"]))["value"] == 9.0
    use = runner.invoke(app, ["config", "use-context", "prod", "--dry-run", "-o", "json"])
    assert json_of(use)["value"] == "prod" and json_of(use)["dry_run"] is True
    assert config.read_bytes() == before and _show()["context"] == "lab"


@pytest.mark.parametrize(("args", "needle"), [
    (["config", "set", "colour", "red", "--context", "a"], "unknown key 'colour'"),
    (["config", "set", "timeout", "soon", "--context", "a"], "timeout must be a positive number"),
    (["config", "set", "timeout", "0", "--context", "a"], "timeout must be a positive number"),
    (["config", "set", "server", "router:7433", "--context", "a"], "http:// or https:// URL"),
])
def test_bad_config_values_exit_2_and_write_nothing(config: Path, args: list[str], needle: str) -> None:
    one_line_error(runner.invoke(app, args), 2, needle)
    assert not config.exists()


def test_a_command_talks_to_the_current_contexts_server(config: Path, tmp_path: Path) -> None:
    with loaded_router(tmp_path / "state") as router:
        url = str(router.base_url).rstrip("/")
        assert runner.invoke(app, ["config", "set", "server", url, "--context", "live"]).exit_code == 0
        workers = json.loads(runner.invoke(app, ["workers", "-o", "json"]).stdout)["workers"]
        assert len(workers) == 4
