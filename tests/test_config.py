"""Settings precedence (flag > env > context > default), with the source of every value."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvctl.config import ConfigFile, resolve
from kvctl.errors import ConfigError


@pytest.fixture
def config(tmp_path: Path) -> ConfigFile:
    path = tmp_path / "config.toml"
    path.write_text('current-context = "prod"\n[contexts.prod]\nserver = "http://prod:7433"\ntoken = "t0k"\n'
                    '[contexts.lab]\nserver = "http://lab:7433"\ntimeout = 9\n')
    return ConfigFile.load(path)


def test_flag_beats_env_beats_context_beats_default(config: ConfigFile) -> None:
    settings = resolve({"server": "http://flag:1"}, env={"KVCTL_TOKEN": "envtok"}, file=config)
    assert settings.server == "http://flag:1" and settings.sources["server"] == "flag"
    assert settings.token == "envtok" and settings.sources["token"] == "env KVCTL_TOKEN"
    assert settings.timeout == 5.0 and settings.sources["timeout"] == "default"
    settings = resolve({}, env={}, file=config)
    assert (settings.server, settings.token, settings.context) == ("http://prod:7433", "t0k", "prod")
    assert settings.sources["server"].startswith("context prod")


def test_context_chosen_by_flag_or_env(config: ConfigFile) -> None:
    assert resolve({}, context="lab", env={}, file=config).timeout == 9
    assert resolve({}, env={"KVCTL_CONTEXT": "lab"}, file=config).server == "http://lab:7433"


def test_no_file_means_defaults(tmp_path: Path) -> None:
    settings = resolve({}, env={}, file=ConfigFile.load(tmp_path / "absent.toml"))
    assert settings.server == "http://127.0.0.1:7433" and settings.context is None


@pytest.mark.parametrize(("text", "context", "needle"), [
    ("[contexts.a]\nserver = 1\nbogus = 2\n", None, "unknown key 'bogus'"),
    ("current-context = 'x'\n", None, "no context 'x'"),
    ("[contexts.a]\ntimeout = -1\n", "a", "timeout must be a positive number"),
    ("not toml [", None, "config.toml"),
    ("[contexts.a]\nserver = 'router:7433'\n", "a", r"'router:7433' \(from context a .* needs a scheme"),
])
def test_bad_config_is_a_config_error(tmp_path: Path, text: str, context: str | None, needle: str) -> None:
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        resolve({}, context=context, env={}, file=ConfigFile.load(path))


@pytest.mark.parametrize("argv", [["--server", "localhost:7433", "workers"], ["workers", "-s", "localhost:7433"]])
def test_a_server_without_a_scheme_is_a_usage_error_naming_the_fix(argv: list[str], tmp_path: Path) -> None:
    """It was exit 3 (cannot reach the server) although nothing was tried: httpx refused the URL."""
    proc = subprocess.run([sys.executable, "-m", "kvctl", *argv], capture_output=True, text=True, timeout=30,
                          env={"KVCTL_CONFIG": str(tmp_path / "none.toml"), "PATH": ""})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "(--server http://localhost:7433)" in proc.stderr, proc.stderr
