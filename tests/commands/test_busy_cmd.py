"""`kvctl busy get / set` against a real router, through Dynamo's /busy_threshold shapes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.commands.live_router import json_of, kvctl, loaded_router, one_line_error

OFF = {"model": "default", "active_decode_blocks_threshold": None, "active_prefill_tokens_threshold": None,
       "active_prefill_tokens_threshold_frac": None}


@pytest.fixture
def router(tmp_path: Path) -> Iterator[httpx.Client]:
    with loaded_router(tmp_path) as client:
        yield client


def _server_side(router: httpx.Client) -> dict:
    return next(t for t in router.get("/busy_threshold").json()["thresholds"] if t["model"] == "default")


def test_set_get_and_unset_roundtrip(router: httpx.Client) -> None:
    assert json_of(kvctl(router, "busy", "get", "-o", "json")) == {"thresholds": [OFF]}
    set_ = json_of(kvctl(router, "busy", "set", "--model", "default", "--active-decode-blocks-threshold", "0.5",
                         "--active-prefill-tokens-threshold", "100", "--yes", "-o", "json"))
    expected = {**OFF, "active_decode_blocks_threshold": 0.5, "active_prefill_tokens_threshold": 100}
    assert set_ == expected == _server_side(router)
    merged = json_of(kvctl(router, "busy", "set", "-m", "default", "--active-prefill-tokens-threshold-frac", "2",
                           "--yes", "-o", "json"))
    assert merged == {**expected, "active_prefill_tokens_threshold_frac": 2.0}  # Dynamo's merge keeps the rest
    unset = json_of(kvctl(router, "busy", "set", "-m", "default", "--unset", "active_prefill_tokens_threshold",
                          "--unset", "active-prefill-tokens-threshold-frac", "--yes", "-o", "json"))
    assert unset == {**OFF, "active_decode_blocks_threshold": 0.5}
    assert json_of(kvctl(router, "busy", "get", "--model", "default", "-o", "json")) == {"thresholds": [unset]}


def test_dry_run_shows_the_result_and_changes_nothing(router: httpx.Client) -> None:
    kvctl(router, "busy", "set", "-m", "default", "--active-prefill-tokens-threshold", "100", "--yes")
    before = _server_side(router)
    foretold = json_of(kvctl(router, "busy", "set", "-m", "default", "--active-decode-blocks-threshold", "0.9",
                             "--unset", "active_prefill_tokens_threshold", "--dry-run", "-o", "json"))
    assert foretold == {**OFF, "active_decode_blocks_threshold": 0.9, "dry_run": True}
    assert _server_side(router) == before


def test_set_refuses_without_a_terminal_or_yes(router: httpx.Client) -> None:
    one_line_error(kvctl(router, "busy", "set", "-m", "default", "--active-decode-blocks-threshold", "0.5"), 2,
                   "--yes")
    assert _server_side(router) == OFF


@pytest.mark.parametrize(("args", "needle"), [
    (["--active-decode-blocks-threshold", "1.5"], "active_decode_blocks_threshold must be a number in [0.0, 1.0]"),
    (["--active-prefill-tokens-threshold", "-1"], "active_prefill_tokens_threshold must be an integer"),
    (["--active-prefill-tokens-threshold", "lots"], "Invalid value for '--active-prefill-tokens-threshold'"),
    (["--unset", "busy_threshold"], "not a threshold"),
    ([], "nothing to change"),
    (["--active-prefill-tokens-threshold", "5", "--unset", "active_prefill_tokens_threshold"], "both set and unset"),
])
def test_bad_values_exit_2_and_send_nothing(router: httpx.Client, args: list[str], needle: str) -> None:
    one_line_error(kvctl(router, "busy", "set", "-m", "default", "--yes", *args), 2, needle)
    assert _server_side(router) == OFF


def test_model_is_required_for_set(router: httpx.Client) -> None:
    one_line_error(kvctl(router, "busy", "set", "--active-decode-blocks-threshold", "0.5", "--yes"), 2, "--model")


def test_unknown_model_is_an_error(router: httpx.Client) -> None:
    one_line_error(kvctl(router, "busy", "set", "-m", "nope", "--active-decode-blocks-threshold", "0.5", "--yes"),
                   1, "Model 'nope' not found")
    one_line_error(kvctl(router, "busy", "get", "-m", "nope"), 1, "models there: default")
