"""`kvctl mock`: parsed `-o json` rows and exit codes, never prose."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvctl.cli import app
from kvctl.mock.timing import TimingModel

runner = CliRunner()


def test_json_rows_describe_every_engine() -> None:
    result = runner.invoke(app, ["mock", "--duration", "1", "-o", "json", "--engines", "2", "--format", "sglang",
                                 "--fault-engine", "1", "--fault-block-size", "32"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [row["worker_id"] for row in rows] == [1, 2]
    assert [row["block_size"] for row in rows] == [16, 32]
    assert {row["format"] for row in rows} == {"sglang"}
    assert all(row["endpoint"].startswith("tcp://127.0.0.1:") and row["url"].startswith("http://127.0.0.1:")
               for row in rows)
    assert len({row["replay_endpoint"] for row in rows}) == 2
    assert {(row["max_running"], row["max_batched_tokens"], row["timing"]) for row in rows} == {
        (16, 8192, TimingModel().describe())}


def test_timing_and_batch_options_reach_every_engine() -> None:
    result = runner.invoke(app, ["mock", "--duration", "1", "-o", "json", "--engines", "2", "--speedup", "4",
                                 "--max-running", "2", "--max-batched-tokens", "64"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [(row["max_running"], row["max_batched_tokens"]) for row in rows] == [(2, 64), (2, 64)]
    assert {row["timing"] for row in rows} == {TimingModel(4).describe()}
    assert list(rows[0])[-1] == "timing"


def test_the_wide_table_names_the_timing_model() -> None:
    result = runner.invoke(app, ["mock", "--duration", "1", "-o", "wide", "--engines", "1"], terminal_width=400)
    assert result.exit_code == 0, result.output
    assert "Dynamo mocker polynomial" in result.stdout
    plain = runner.invoke(app, ["mock", "--duration", "1", "--engines", "1"], terminal_width=400)
    assert "Dynamo mocker polynomial" not in plain.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--engines", "0"], "--engines must be positive"),
        (["--format", "trtllm"], "--format must be one of"),
        (["--block-size", "0"], "block sizes must be positive"),
        (["--capacity", "-1"], "--capacity must be positive"),
        (["--duration", "0"], "--duration must be > 0"),
        (["--restart-after", "-2"], "--restart-after must be > 0"),
        (["--drop-every", "-1"], "--drop-every must not be negative"),
        (["--speedup", "0"], "--speedup must be > 0"),
        (["--speedup", "-2.5"], "--speedup must be > 0"),
        (["--max-running", "0"], "--max-running must be positive"),
        (["--max-batched-tokens", "-1"], "--max-batched-tokens must be positive"),
        (["--base-port", "65535"], "leaves no room"),
        (["--engines", "2", "--fault-engine", "2"], "fault engine indexes must be in 0..1"),
        (["--format", "dynamo-nats", "--nats", "nats://127.0.0.1:4222", "--config-out", "f.toml"],
         "--config-out declares ZMQ endpoints"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args: list[str], needle: str) -> None:
    result = runner.invoke(app, ["mock", *args])
    assert result.exit_code == 2
    assert needle in result.stderr and len(result.stderr.splitlines()) == 1
    assert result.stdout == ""


def test_the_command_offers_exactly_the_engine_formats() -> None:
    from kvctl.commands.mock import FORMATS
    from kvctl.mock.engine import MOCK_FORMATS

    assert FORMATS == MOCK_FORMATS


def test_mock_load_help_says_it_registers_the_engines_file_s_engines() -> None:
    result = runner.invoke(app, ["mock", "load", "--help"])
    words = " ".join(result.stdout.replace("│", " ").split())  # the option's help, unwrapped
    assert "are registered with it (POST /v1/workers, under --model), and it says so" in words
