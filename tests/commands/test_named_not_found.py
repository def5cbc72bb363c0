"""One rule for a worker or model named on the command line (kubectl's): one that does not exist is an error,
exit 1, one line naming what does; a filter of something that exists but matches nothing is an empty answer."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from kvctl.exit_codes import CheckStatus
from tests.commands.live_router import WORKERS, kvctl, loaded_router, one_line_error, url_of
from tests.doctor.rig import doctor
from tests.fixtures_path import FIXTURES

DUMP_FILE = str(FIXTURES / "dynamo-1.6.1" / "dump.jsonl")
THE_WORKERS = "workers there: 1:0, 2:0, 2:1, 9223372036854775815:0"  # numerically sorted


@pytest.fixture(scope="module")
def router(module_route_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    with loaded_router(tmp_path_factory.mktemp("router")) as client:
        assert client.post("/v1/workers", json={"worker_id": 5, "model": "default"}).status_code == 201
        yield client  # the dump's workers, and 5:0: registered, holding no blocks


@pytest.mark.parametrize(("args", "needles"), [
    (["workers", "--model", "nope"], ["has no model 'nope'", "models there: default"]),
    (["route", "--model", "nope", "1", "2"], ["unknown model 'nope'", "models there: default"]),
    (["tree", "stats", "--model", "nope"], ["unknown model 'nope'", "models there: default"]),
    (["busy", "get", "--model", "nope"], ["model 'nope'", "models there: default"]),
    (["events", "replay", DUMP_FILE, "--model", "nope", "--yes"], ["unknown model 'nope'", "models there: default"]),
    (["tree", "dump", "--worker", "99"], ["has no worker 99", THE_WORKERS]),
    (["tree", "dump", DUMP_FILE, "--worker", "2:5"], [f"the index of {DUMP_FILE} has no worker 2:5", THE_WORKERS]),
    (["router", "reset", "--worker", "99", "--yes"], ["has no worker 99", "workers there: 1:0, 2:0, 2:1, 5:0, 9"]),
    (["router", "reset", "--worker", "2", "--model", "nope", "--yes"], ["has no worker 2 in model 'nope'"]),
])
def test_a_named_thing_that_is_not_there_is_exit_1_naming_what_is(router: httpx.Client, args: list[str],
                                                                    needles: list[str]) -> None:
    before = router.get("/v1/tree/stats").json()
    result = kvctl(router, *args)
    for needle in needles:
        one_line_error(result, 1, needle)
    assert router.get("/v1/tree/stats").json() == before


def test_doctor_of_a_model_not_there_is_unknown(router: httpx.Client) -> None:
    code, report = doctor(url_of(router), "--model", "nope")
    assert code == CheckStatus.UNKNOWN and [f["severity"] for f in report["findings"]] == ["UNKNOWN"]
    assert report["findings"][0]["cause"].endswith("has no model 'nope'") and "default" in report["findings"][0][
        "next_step"]


def test_something_there_that_matches_nothing_is_an_empty_answer(router: httpx.Client) -> None:
    assert set(kvctl(router, "-o", "name", "workers", "--model", "default").stdout.split()) == WORKERS | {"5:0"}
    reset = kvctl(router, "router", "reset", "--worker", "5", "--yes", "-o", "json")  # registered, no blocks
    assert reset.exit_code == 0 and reset.stderr == "warning: no worker 5 holds blocks\n", reset.output
    assert kvctl(router, "tree", "dump", "--worker", "2").exit_code == 0
