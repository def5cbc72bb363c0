"""A real `kvctl serve` process for command tests, loaded with the index of Dynamo 1.6.1's dump fixture.

The dump's workers: 1:0, 2:0, 2:1 and 9223372036854775815:0 (2^63+7). `PROMPT` (4 blocks of 16 tokens)
is fully cached on 1:0 and 2:1, 2 blocks deep on 2^63+7, not at all on 2:0.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from click.testing import Result
from typer.testing import CliRunner

from kvctl.cli import app
from tests.fixtures_path import FIXTURES
from tests.server.test_serve_process import serving

DYNAMO = FIXTURES / "dynamo-1.6.1"
DUMP = (DYNAMO / "dump.jsonl").read_text()
PROMPT: list[int] = json.loads((DYNAMO / "inputs.json").read_text())["token_ids"]["P"]
PROMPT_HASHES: list[int] = json.loads((DYNAMO / "queries.json").read_text())["queries"][0]["local_hashes"]
WORKERS = {"1:0", "2:0", "2:1", "9223372036854775815:0"}
DUMP_BLOCKS = 18


@contextmanager
def loaded_router(state_dir: Path) -> Iterator[httpx.Client]:
    """A fresh router holding the dump's index; the client's base URL is the router's."""
    with serving(state_dir, "--no-restore") as (_, client):
        answer = client.post("/v1/events", content=DUMP, headers={"content-type": "application/x-ndjson"}).json()
        assert answer["rejected"] == {}
        yield client


def url_of(client: httpx.Client) -> str:
    return str(client.base_url).rstrip("/")


def kvctl(client: httpx.Client | str, *args: str, input: str | None = None, env: dict[str, str] | None = None
          ) -> Result:
    """`kvctl --server URL ARGS…` in-process, as a script would run it (no terminal)."""
    url = client if isinstance(client, str) else url_of(client)
    return CliRunner().invoke(app, ["--server", url, *args], input=input, env=env)


def json_of(result: Result) -> Any:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def free_port_url() -> str:
    """A loopback URL nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def one_line_error(result: Result, code: int, needle: str) -> None:
    """The command failed with `code` and said so on one stderr line naming `needle`."""
    assert result.exit_code == code, result.output
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert needle in result.stderr, result.stderr
