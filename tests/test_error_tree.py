"""The router's own failures are the one error tree's (kvctl/errors.py): each raises as its type there, carrying
its exit code, and the CLI says it in one line with that code, without a handler of its own."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvctl.commands.serve import router_config
from kvctl.errors import CannotListen, DiscoveryError, StateDirError, Unreachable, UsageError
from kvctl.exit_codes import ExitCode
from kvctl.server.daemon import bind
from kvctl.server.plane.dynamo_discovery import FileDiscovery
from kvctl.server.state_dir import claim


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
        router_config({}, None, None, path)
    code, err = _kvctl("serve", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state"),
                       "--router-policy-config", str(path))
    assert code == ExitCode.USAGE and f"--router-policy-config {path}: " in _one_line(err)
