"""The config file writer: TOML that `tomllib` reads back exactly, written atomically."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from kvctl.config import ConfigFile, writer
from kvctl.errors import ConfigError, KvctlError

AWKWARD = ['plain', 'quo"te', "back\\slash", "new\nline\ttab", "ctrl\x01\x1f\x7f", "ünïcødé 🚀", "", "'single'"]


@pytest.mark.parametrize("text", AWKWARD)
def test_strings_and_context_names_read_back_exactly(text: str) -> None:
    data = {"current-context": text, "contexts": {text: {"server": text, "token": text, "timeout": 0.5},
                                                  "plain-name_1": {"timeout": 3}}}
    assert tomllib.loads(writer.render(data)) == data


def test_none_values_are_left_out_and_unknown_top_level_keys_refused() -> None:
    assert tomllib.loads(writer.render({"contexts": {"a": {"token": None, "timeout": 1.0}}})) == {
        "contexts": {"a": {"timeout": 1.0}}}
    with pytest.raises(ConfigError, match="editor"):
        writer.render({"editor": "vim"})
    with pytest.raises(ConfigError, match="timeout"):
        writer.render({"contexts": {"a": {"timeout": float("inf")}}})


def test_write_is_atomic_keeps_the_mode_and_follows_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "dotfiles" / "kvctl.toml"
    real.parent.mkdir()
    real.write_text("")
    real.chmod(0o640)
    link = tmp_path / "config.toml"
    link.symlink_to(real)
    writer.write(link, {"current-context": "a", "contexts": {"a": {"server": "http://a:1"}}})
    assert link.is_symlink() and ConfigFile.load(link).current == "a"
    assert real.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in real.parent.iterdir()) == ["kvctl.toml"]  # no temporary file left


def test_a_new_file_is_private_and_a_failed_write_is_one_error(tmp_path: Path) -> None:
    fresh = tmp_path / "new" / "config.toml"
    writer.write(fresh, {"contexts": {"a": {"token": "secret"}}})
    assert fresh.stat().st_mode & 0o777 == 0o600
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    with pytest.raises(KvctlError, match="cannot write the config file"):
        writer.write(blocker / "config.toml", {})
