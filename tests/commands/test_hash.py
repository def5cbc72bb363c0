"""`kvctl hash`: exit codes and parsed `-o json` output, never prose."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvctl.cli import app
from tests.core.test_hashing import VECTORS

runner = CliRunner()


@pytest.mark.parametrize("case", VECTORS["cases"], ids=lambda c: c["case"])
def test_json_output_equals_dynamo_vectors(case: dict) -> None:
    args = ["hash", "-o", "json", "--block-size", str(case["block_size"]), "--", *map(str, case["tokens"])]
    if not case["tokens"]:
        args = ["hash", "-o", "json", "--block-size", str(case["block_size"]), "--file", "/dev/null"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {
        "block_size": case["block_size"],
        "local_hashes": case["local_block_hashes_u64"],
        "sequence_hashes": case["sequence_hashes_u64"],
    }


def test_stdin_file_and_lora(tmp_path) -> None:
    path = tmp_path / "prompt.txt"
    path.write_text("[1, 2, 3, 4]\n")
    from_file = runner.invoke(app, ["hash", "--json", "-b", "4", "--lora-name", "my-adapter", "--file", str(path)])
    from_stdin = runner.invoke(app, ["hash", "--json", "-b", "4", "--lora-name", "my-adapter"], input="1 2 3 4")
    assert from_file.exit_code == from_stdin.exit_code == 0
    assert json.loads(from_file.stdout) == json.loads(from_stdin.stdout)
    assert json.loads(from_file.stdout)["local_hashes"] == [15633847640104431966]


SALTED_OR_EAGLE = [v for v in VECTORS["variants"] if {"cache_namespace", "is_eagle"} & set(v["kwargs"])]


@pytest.mark.parametrize("variant", SALTED_OR_EAGLE, ids=lambda v: v["case"])
def test_salted_and_eagle_hashes_equal_dynamo_vectors(variant: dict) -> None:
    """`--cache-salt` and `--eagle` show the hashes an SGLang worker's salted or EAGLE stores carry."""
    kwargs = variant["kwargs"]
    option = ["--cache-salt", kwargs["cache_namespace"]] if "cache_namespace" in kwargs else ["--eagle"]
    result = runner.invoke(app, ["hash", "--json", "-b", str(variant["block_size"]), *option,
                                 *map(str, variant["tokens"])])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["local_hashes"] == variant["local_block_hashes_u64"]
    assert result.stderr == ""  # an EAGLE worker's n blocks take nB + 1 tokens: none left over


def test_global_output_flag_and_name_mode() -> None:
    result = runner.invoke(app, ["-o", "name", "hash", "-b", "4", "1", "2", "3", "4", "5", "6", "7", "8"])
    assert result.exit_code == 0
    assert result.stdout.split() == ["14643705804678351452", "4945711292740353085"]


def test_partial_block_warns_on_stderr_only() -> None:
    result = runner.invoke(app, ["hash", "-o", "json", "-b", "4", "1", "2", "3", "4", "5"])
    assert result.exit_code == 0
    assert json.loads(result.stdout)["local_hashes"] == [14643705804678351452]
    assert "not hashed" in result.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["hash", "1", "x"], "not an integer"),
        (["hash", "--", "-1"], "outside [0, 2^32)"),
        (["hash", "4294967296"], "outside [0, 2^32)"),
        (["hash", "-b", "0", "1"], "--block-size must be positive"),
        (["hash", "-b", "-3", "1"], "--block-size must be positive"),
        (["hash", "-b", "x", "1"], "--block-size"),
        (["hash", "--bogus"], "--bogus"),
    ],
)
def test_bad_input_exits_2_with_one_line(args: list[str], needle: str) -> None:
    result = runner.invoke(app, args, input="")
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0]
    assert result.stdout == ""


def test_version() -> None:
    from kvctl import __version__
    from kvctl.core import native

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"kvctl {__version__} (native speedups: {native.IMPLEMENTATION})"


def test_the_file_examples_show_what_file_takes(tmp_path, monkeypatch) -> None:
    """--file takes token ids, not a prompt's text: the examples name a file of token ids, and each runs on
    one written as the help says (a JSON list); a text file is refused with a hint to tokenize first."""
    import shlex

    from kvctl.commands import hash as hash_cmd
    from kvctl.commands import route

    examples = [line.split("#")[0] for text in (hash_cmd.EXAMPLES, route.EXAMPLES) for line in text.splitlines()
                if "kvctl hash --file" in line]
    files = {shlex.split(line)[shlex.split(line).index("--file") + 1] for line in examples}
    assert files == {"token-ids.json"}
    monkeypatch.chdir(tmp_path)
    (tmp_path / "token-ids.json").write_text("[1, 2, 3, 4]")
    result = runner.invoke(app, ["hash", "--file", "token-ids.json", "-b", "4", "-o", "json"])
    assert result.exit_code == 0 and len(json.loads(result.stdout)["local_hashes"]) == 1
    (tmp_path / "prompt.txt").write_text("Hello there")
    result = runner.invoke(app, ["hash", "--file", "prompt.txt"])
    assert result.exit_code == 2 and "not text: tokenize the prompt first" in result.stderr
