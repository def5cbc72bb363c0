"""kvctl's Python children run the installed kvctl even when started from a folder holding another `kvctl`
package (the folder above a checkout): `python -m` would import that one first."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvctl.core.events import EngineBatch
from kvctl.mock.demo import router_process
from kvctl.server.ingest.decode_process.parent import ProcessDecoder, decode_now
from tests.fixtures_path import FIXTURES
from tests.plain_events import plain


@pytest.fixture
def foreign_kvctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working directory holds a `kvctl` package that fails on import."""
    (tmp_path / "kvctl").mkdir()
    (tmp_path / "kvctl" / "__init__.py").write_text("raise ImportError('the working directory was imported')\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


async def test_the_demo_router_starts_from_a_folder_with_another_kvctl(foreign_kvctl: Path) -> None:
    async with router_process(foreign_kvctl / "state", 16) as (url, _), httpx.AsyncClient() as client:
        assert (await client.get(f"{url}/v1/status")).status_code == 200


async def test_the_decode_process_starts_from_a_folder_with_another_kvctl(foreign_kvctl: Path) -> None:
    payload = next((FIXTURES / "vllm-0.33").glob("*.msgpack")).read_bytes()
    decoder = ProcessDecoder(max_pending=4)
    got = []
    try:
        decoder.submit(payload, 16, got.append)
        await decoder.drained()
        assert decoder.status()["failed"] is None
    finally:
        await decoder.close()
    assert isinstance(got[0], EngineBatch)
    assert list(map(plain, got[0].events)) == list(map(plain, decode_now(payload, 16).events))
