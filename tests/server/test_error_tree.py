"""The router's own errors are the error tree's (kvctl/errors.py): a bad serve config file, a damaged snapshot,
an unknown model, an unusable state dir, a port that cannot be had and an unreachable discovery store each raise
as the tree's type and reach the user as one line, with the exit code or HTTP status the tree gives them."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl import errors
from kvctl.cli import app
from kvctl.commands._serve_routing import router_config
from kvctl.errors import CannotListen, DiscoveryError, KvctlError, StateDirError, Unreachable, UsageError
from kvctl.exit_codes import ExitCode
from kvctl.server.config_file import load
from kvctl.server.http.api import create_app
from kvctl.server.listen import bind
from kvctl.server.persistence import snapshot
from kvctl.server.persistence.state_dir import claim
from kvctl.server.plane.dynamo_discovery import FileDiscovery
from kvctl.server.state import Fleet
from tests.server.test_serve_process import _stop, serving
from tests.support.served import served

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


async def test_an_unknown_model_is_not_found_and_a_404_naming_the_models(route_path: str) -> None:
    fleet = Fleet(block_size=16)
    with pytest.raises(KvctlError) as caught:
        fleet.model("nope")
    assert isinstance(caught.value, errors.NotFound) and caught.value.status == 404
    assert (caught.value.message, caught.value.hint) == (UNKNOWN, "models there: default")
    async with served(create_app(fleet), route_path) as client:
        for answer in (await client.post("/v1/route", json={"model": "nope", "token_ids": [1]}),  # `route_path`
                       await client.get("/v1/tree/stats", params={"model": "nope"})):  # the app's handler
            assert answer.status_code == 404 and answer.json() == {"error": UNKNOWN, "models": ["default"]}


def _kvctl(*args: str) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "kvctl", *args], capture_output=True, text=True, timeout=30)
    return proc.returncode, proc.stderr


def _one_line(err: str) -> str:
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_a_state_dir_that_cannot_be_used_is_a_usage_error(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(UsageError) as caught:
        claim(not_a_dir, "127.0.0.1:0")
    assert isinstance(caught.value, StateDirError) and caught.value.exit_code == ExitCode.USAGE
    code, err = _kvctl("serve", "--listen", "127.0.0.1:0", "--state-dir", str(not_a_dir))
    assert code == ExitCode.USAGE and f"--state-dir {not_a_dir} is not a writable directory" in _one_line(err)


def test_an_address_taken_is_a_usage_error_naming_it(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(UsageError) as caught:
            bind("127.0.0.1", taken.getsockname()[1])
        assert isinstance(caught.value, CannotListen) and caught.value.exit_code == ExitCode.USAGE
        assert caught.value.message.startswith(f"cannot listen on {address}: ")
        code, err = _kvctl("serve", "--listen", address, "--state-dir", str(tmp_path))
    assert code == ExitCode.USAGE and f"cannot listen on {address}: " in _one_line(err) and "--listen" in err


async def test_a_discovery_store_that_cannot_be_read_is_unreachable(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(Unreachable) as caught:
        await FileDiscovery(not_a_dir).list("v1/event_channels/")
    assert isinstance(caught.value, DiscoveryError) and caught.value.exit_code == ExitCode.UNREACHABLE
    code, err = _kvctl("events", "tail", "--dynamo-discovery", f"file:{not_a_dir}", "--duration", "5")
    assert code == ExitCode.UNREACHABLE and f"{not_a_dir} is not a directory" in _one_line(err)


def test_a_policy_file_dynamo_refuses_is_a_usage_error(tmp_path: Path) -> None:
    """The core's own ValueError (it imports nothing of kvctl), made the tree's where the file is read."""
    path = tmp_path / "policy.yaml"
    path.write_text("worker_selection: [not, a, table]\n")
    with pytest.raises(UsageError, match=f"--router-policy-config {path}: "):
        router_config({}, None, None, path, None)
    code, err = _kvctl("serve", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state"),
                       "--router-policy-config", str(path))
    assert code == ExitCode.USAGE and f"--router-policy-config {path}: " in _one_line(err)
