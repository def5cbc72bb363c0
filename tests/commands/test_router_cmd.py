"""`kvctl router reset / status` against a real router: exit codes and parsed `-o json` output."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.commands.live_router import (
    DUMP_BLOCKS,
    WORKERS,
    free_port_url,
    json_of,
    kvctl,
    loaded_router,
    one_line_error,
    url_of,
)


@pytest.fixture
def router(tmp_path: Path) -> Iterator[httpx.Client]:
    with loaded_router(tmp_path) as client:
        yield client


def _blocks(router: httpx.Client) -> dict[str, int]:
    return router.get("/v1/tree/stats").json()["models"]["default"]["workers"]


def test_reset_with_yes_clears_everything(router: httpx.Client) -> None:
    [cleared] = json_of(kvctl(router, "router", "reset", "--yes", "-o", "json"))["cleared"]
    assert cleared["model"] == "default" and set(cleared["workers"]) == WORKERS and cleared["blocks"] == DUMP_BLOCKS
    assert router.get("/v1/tree/stats").json()["models"]["default"]["blocks"] == 0


def test_dry_run_changes_nothing_and_foretells_the_reset(router: httpx.Client) -> None:
    before = _blocks(router)
    foretold = json_of(kvctl(router, "router", "reset", "--worker", "2", "--dry-run", "-o", "json"))
    assert foretold.pop("dry_run") is True
    assert _blocks(router) == before
    done = json_of(kvctl(router, "router", "reset", "--worker", "2", "--yes", "-o", "json"))
    assert foretold == done
    assert done["cleared"][0]["workers"] == ["2:0", "2:1"]
    assert _blocks(router) == {**before, "2:0": 0, "2:1": 0}


def test_reset_one_rank_of_one_model(router: httpx.Client) -> None:
    done = json_of(kvctl(router, "router", "reset", "--model", "default", "--worker", "2:1", "-y", "-o", "json"))
    assert done["cleared"] == [{"model": "default", "workers": ["2:1"], "blocks": 7}]
    assert _blocks(router)["2:0"] == 1


def test_reset_refuses_without_a_terminal_or_yes(router: httpx.Client) -> None:
    before = _blocks(router)
    one_line_error(kvctl(router, "router", "reset"), 2, "--yes")
    assert _blocks(router) == before


def test_declining_the_prompt_at_a_terminal_changes_nothing_and_is_no_error(router: httpx.Client) -> None:
    """Asked on a terminal (a pty here), "n" is an answer: nothing changes, exit 0, no `error:` (issue 37)."""
    before = _blocks(router)
    leader, follower = pty.openpty()
    with subprocess.Popen([sys.executable, "-m", "kvctl", "--server", url_of(router), "router", "reset", "--worker",
                           "2"], stdin=follower, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        os.close(follower)
        os.write(leader, b"n\n")
        out, err = proc.communicate(timeout=30)
    os.close(leader)
    assert proc.returncode == 0 and out.strip() == "", err  # click asks with input(" "): its space is on stdout
    assert f"clear worker 2's blocks from the index of every model on {url_of(router)}? [y/N]" in err
    assert err.rstrip().endswith("cancelled: nothing was changed") and "error" not in err
    assert _blocks(router) == before


@pytest.mark.parametrize(("args", "needle"), [
    (["router", "reset", "--worker", "x", "--yes"], "--worker: a worker is ID or ID:DP"),
    (["router", "reset", "--worker", "+2", "--yes"], "--worker: a worker is ID or ID:DP"),  # int() took it
    (["router", "reset", "--worker", "1:-1", "--yes"], "0..2^32-1"),
    (["router", "status", "--interval", "0"], "--interval must be > 0"),
    (["router", "reset", "--bogus"], "--bogus"),
])
def test_bad_arguments_exit_2_with_one_line(router: httpx.Client, args: list[str], needle: str) -> None:
    one_line_error(kvctl(router, *args), 2, needle)


def test_reset_of_an_unknown_model_is_a_server_error(router: httpx.Client) -> None:
    one_line_error(kvctl(router, "router", "reset", "--model", "nope", "--yes"), 1, "unknown model 'nope'")


def test_status_reports_each_engine_stream(router: httpx.Client) -> None:
    endpoint = free_port_url().replace("http://", "tcp://")  # nothing publishes: the stream waits
    assert router.post("/v1/workers", json={"worker_id": 7, "endpoint": endpoint}).status_code == 201
    status = json_of(kvctl(router, "router", "status", "-o", "json"))
    assert status["event_plane"] is None
    [stream] = status["streams"]
    assert stream["worker"] == {"worker_id": 7, "dp_rank": 0} and stream["endpoint"] == endpoint
    assert stream["messages"] == 0 and stream["gaps"] == 0
    table = kvctl(router, "router", "status", "-o", "wide")
    assert table.exit_code == 0 and "waiting" in table.stdout
    assert kvctl(router, "-o", "name", "router", "status").stdout == "7:0\n"


def test_status_watch_prints_one_json_object_a_line(router: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    sleeps = iter([None, None, KeyboardInterrupt()])

    def sleep(_: float) -> None:
        step = next(sleeps)
        if step is not None:
            raise step

    monkeypatch.setattr("kvctl.commands._watch.time.sleep", sleep)
    result = kvctl(router, "router", "status", "--watch", "--interval", "0.1", "-o", "json")
    assert result.exit_code == 0  # Ctrl-C ends a watch normally
    lines = [line for line in result.stdout.splitlines() if line]
    assert len(lines) == 3 and all(line.startswith("{") and '"streams":' in line for line in lines)


@pytest.mark.parametrize("args", [
    ["router", "status"], ["router", "reset", "--yes"], ["router", "reset", "--dry-run"], ["workers"],
    ["busy", "get"], ["busy", "set", "-m", "default", "--active-prefill-tokens-threshold", "5", "--yes"],
    ["route", "1", "2", "3"],
])
def test_unreachable_router_exits_3_naming_the_url(args: list[str]) -> None:
    url = free_port_url()
    one_line_error(kvctl(url, *args), 3, url)
