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


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--request-rate", "0"], "--request-rate must be > 0, got 0"),
        (["--ttft-slo", "-5"], "--ttft-slo must be > 0, got -5"),
        (["--request-rate", "5", "--drain-timeout", "0"], "--drain-timeout must be > 0"),
        (["--arrival", "constant"], "--arrival spaces the arrivals of --request-rate (add --request-rate"),
        (["--request-rate", "5", "--arrival", "bursty"], "'bursty' is not one of 'poisson', 'constant'"),
        (["--request-rate", "5", "--concurrency", "0"], "--concurrency"),
        (["--request-rate", "5", "--trace", __file__],
         "a trace brings its own arrival times (use --speed to replay it faster)"),
    ],
)
def test_bad_load_arguments_exit_2_with_one_line(args: list[str], needle: str) -> None:
    result = runner.invoke(app, ["mock", "load", "--engine", "1=http://127.0.0.1:1", *args])
    assert result.exit_code == 2, result.output
    assert needle in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stdout == ""


def _table(reports: list[dict], fmt: str) -> list[dict[str, str]]:
    """The load table as `mock load` prints it, each row by header."""
    import io
    import re

    from kvctl.commands.mock import _load_view
    from kvctl.output import Output, OutputFormat

    stdout = io.StringIO()
    Output(format=OutputFormat(fmt), color=False, stdout=stdout).emit(reports, _load_view(reports))
    header, *rows = (re.split(r"\s{2,}", line) for line in stdout.getvalue().splitlines())
    return [dict(zip(header, row, strict=True)) for row in rows]


def test_load_table_shows_goodput_and_offered_load_only_when_the_run_has_them() -> None:
    from kvctl.mock.load import LoadStats, Policy

    opened = LoadStats(Policy.router, ttft_slo_ms=50.0, open_loop=True, offered_per_s=40.0, completed=2, good=1,
                       first_sent=0.0, last_done=1.0, ttft_ms=[10.0, 90.0], e2e_ms=[20.0, 100.0],
                       dispatch_lag_ms=[0.5, 1.5])
    opened.router_ms["route"] += [1.0, 3.0]
    opened.router_ms["free"] += [2.0, 2.0]
    [row] = _table([opened.report()], "wide")
    assert (row["OFFERED/S"], row["REQ/S"], row["GOODPUT/S"]) == ("40", "2", "1")
    assert (row["TTFT P50 MS"], row["TTFT P90 MS"], row["E2E P99 MS"]) == ("50", "82", "99.2")
    assert (row["ROUTE P50/P99 MS"], row["FREE P50/P99 MS"], row["PREFILL COMPLETE P50/P99 MS"]) == (
        "2/2.98", "2/2", "-")
    assert row["LAG P99 MS"] == "1.49"
    [plain] = _table([LoadStats(Policy.random).report()], "table")
    assert set(plain) == {"POLICY", "HIT RATE", "REQUESTS", "REQ/S", "TTFT P50 MS", "TTFT P90 MS", "TTFT P99 MS",
                          "E2E P50 MS", "E2E P99 MS"}
