"""The model a command reads when none is given (issue 37): a router whose workers serve one model named otherwise
(`kvctl mock --config-out` names it `mock`) is read as that model, never as an empty `default`; with several, the
command says which models have workers; a route for a model without workers names it and where workers are."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.commands.live_router import DUMP, DUMP_BLOCKS, PROMPT, json_of, kvctl
from tests.server.test_serve_process import serving


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """A router whose only workers serve model `mock`, holding the dump fixture's index under it."""
    with serving(tmp_path_factory.mktemp("state"), "--no-restore") as (_, client):
        for worker in (1, 2, 9223372036854775815):
            client.post("/v1/workers", json={"worker_id": worker, "model": "mock"}).raise_for_status()
        answer = client.post("/v1/events", params={"model": "mock"}, content=DUMP,
                             headers={"content-type": "application/x-ndjson"}).json()
        assert answer["rejected"] == {}
        yield client


def test_the_only_model_with_workers_is_read_without_m(router: httpx.Client) -> None:
    stats = json_of(kvctl(router, "tree", "stats", "-o", "json"))
    assert stats["blocks"] == DUMP_BLOCKS
    decision = kvctl(router, "route", *map(str, PROMPT), "-o", "json")
    assert json_of(decision)["overlap_blocks"] == 4 and decision.stderr == ""


def test_a_context_or_the_flag_still_names_the_model(router: httpx.Client) -> None:
    assert json_of(kvctl(router, "tree", "stats", "-m", "default", "-o", "json"))["blocks"] == 0
    assert json_of(kvctl(router, "tree", "stats", "-o", "json", env={"KVCTL_MODEL": "default"}))["blocks"] == 0


def test_a_route_for_a_model_without_workers_names_it_and_the_models_with_some(router: httpx.Client) -> None:
    result = kvctl(router, "route", "-m", "default", *map(str, PROMPT))
    assert result.exit_code == 1
    assert "model 'default' has no workers to route to; models with workers: mock (4)" in result.stderr


def test_with_several_models_the_default_is_read_and_the_others_named(router: httpx.Client) -> None:
    router.post("/v1/workers", json={"worker_id": 77, "model": "other"}).raise_for_status()
    try:
        result = kvctl(router, "tree", "stats", "-o", "json")
        assert json_of(result)["blocks"] == 0
        assert ("model 'default' has no workers; models with workers: mock (4 workers), other (1 worker); "
                "pass -m MODEL") in result.stderr
    finally:
        router.delete("/v1/workers/77").raise_for_status()
