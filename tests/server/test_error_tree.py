"""The router's own errors are the error tree's (kvctl/errors.py): a bad serve config file, a damaged snapshot and
an unknown model each reach the user as one line, with the exit code or HTTP status the tree gives them."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from kvctl import errors
from kvctl.cli import app
from kvctl.errors import KvctlError
from kvctl.exit_codes import ExitCode
from kvctl.server import snapshot
from kvctl.server.config_file import load
from kvctl.server.http.api import create_app
from kvctl.server.state import Fleet
from tests.server.test_serve_process import _stop, serving

UNKNOWN = ("unknown model 'nope': a model is declared in `kvctl serve --config` ([[models]]) or made by "
           "registering a worker for it (POST /v1/workers)")


def test_a_bad_serve_config_is_a_config_error_exit_2_on_one_line(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('[[models]]\nname = ""\n')
    with pytest.raises(KvctlError) as caught:
        load(config)
    assert isinstance(caught.value, errors.ConfigError) and caught.value.exit_code == ExitCode.USAGE
    result = CliRunner().invoke(app, ["serve", "--config", str(config), "--state-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr == f"error: {config}: models[0]: name must be a non-empty string, got ''\n"


def test_a_damaged_snapshot_is_a_snapshot_error_and_one_log_line_at_start(tmp_path: Path) -> None:
    damaged = tmp_path / snapshot.FILENAME
    damaged.write_text('{"schema": "kvctl.snapshot/v2"}\n')  # no trailer: a write cut short
    with pytest.raises(KvctlError) as caught:
        snapshot._read(damaged)
    assert isinstance(caught.value, errors.SnapshotError) and caught.value.exit_code == ExitCode.ERROR
    problem = f"{damaged}: no trailer: the write was cut short (moved to {snapshot.FILENAME}.damaged)"
    with serving(tmp_path) as (proc, client):  # a start never fails on a damaged snapshot: it goes without it
        restore = client.get("/v1/status").json()["restore"]
        assert (restore["file"], restore["events"], restore["problems"]) == (None, 0, [problem])
        log = _stop(proc)
    told = [line for line in log.splitlines() if "damaged snapshot" in line]
    assert len(told) == 1 and told[0].endswith(f"ERROR kvctl.serve: damaged snapshot: {problem}"), log


async def test_an_unknown_model_is_not_found_and_a_404_naming_the_models() -> None:
    fleet = Fleet(block_size=16)
    with pytest.raises(KvctlError) as caught:
        fleet.model("nope")
    assert isinstance(caught.value, errors.NotFound) and caught.value.status == 404
    assert (caught.value.message, caught.value.hint) == (UNKNOWN, "models there: default")
    app_ = create_app(fleet)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app_), base_url="http://kvctl") as client:
        for answer in (await client.post("/v1/route", json={"model": "nope", "token_ids": [1]}),  # the fast path
                       await client.get("/v1/tree/stats", params={"model": "nope"})):  # the app's handler
            assert answer.status_code == 404 and answer.json() == {"error": UNKNOWN, "models": ["default"]}
