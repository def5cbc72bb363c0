"""`kvctl busy get / set -s FRONTEND` against Dynamo 1.6.1's own frontend (its `/busy_threshold`).

Dynamo's POST cannot clear a threshold, so a test that sets some cannot put the frontend back as it was: these
tests use a frontend of their own, started beside the fleet's (same workers, same discovery) and stopped after.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.commands.live_router import json_of, kvctl, one_line_error
from tests.interop.fleet import MODEL, Fleet, Frontend

OFF = {"model": MODEL, "active_decode_blocks_threshold": None, "active_prefill_tokens_threshold": None,
       "active_prefill_tokens_threshold_frac": None}


@pytest.fixture
def frontend(fleet: Fleet) -> Iterator[Frontend]:
    started = fleet.start_frontend("frontend-busy")
    try:
        fleet.await_frontend(started)
        yield started
    finally:
        fleet.stop_frontend(started)


def _frontends_own(frontend: Frontend) -> dict:
    """The thresholds as the frontend itself answers them (not through kvctl)."""
    answer = httpx.get(f"{frontend.url}/busy_threshold", timeout=10).json()["thresholds"]
    return next(t for t in answer if t["model"] == MODEL)


def test_busy_set_is_read_back_by_get_on_a_dynamo_frontend(frontend: Frontend) -> None:
    assert json_of(kvctl(frontend.url, "busy", "get", "-o", "json")) == {"thresholds": [OFF]}

    set_ = json_of(kvctl(frontend.url, "busy", "set", "--model", MODEL, "--active-decode-blocks-threshold", "0.85",
                         "--active-prefill-tokens-threshold", "5000", "--yes", "-o", "json"))
    expected = {**OFF, "active_decode_blocks_threshold": 0.85, "active_prefill_tokens_threshold": 5000}
    assert set_ == expected == _frontends_own(frontend)
    assert json_of(kvctl(frontend.url, "busy", "get", "-o", "json")) == {"thresholds": [expected]}

    # Dynamo merges: naming one threshold keeps the others.
    merged = json_of(kvctl(frontend.url, "busy", "set", "-m", MODEL, "--active-prefill-tokens-threshold-frac", "1.5",
                           "--yes", "-o", "json"))
    expected = {**expected, "active_prefill_tokens_threshold_frac": 1.5}
    assert merged == expected
    assert json_of(kvctl(frontend.url, "busy", "get", "--model", MODEL, "-o", "json")) == {"thresholds": [expected]}
    assert _frontends_own(frontend) == expected


def test_unset_is_refused_by_a_dynamo_frontend_and_changes_nothing(frontend: Frontend) -> None:
    kvctl(frontend.url, "busy", "set", "-m", MODEL, "--active-prefill-tokens-threshold", "5000", "--yes")
    before = _frontends_own(frontend)
    assert before["active_prefill_tokens_threshold"] == 5000
    result = kvctl(frontend.url, "busy", "set", "-m", MODEL, "--unset", "active_prefill_tokens_threshold", "--yes")
    # kvctl's DELETE /busy_threshold: the frontend answers 405, and kvctl says a frontend cannot unset over HTTP
    one_line_error(result, 1, "a Dynamo frontend cannot unset a threshold over HTTP")
    assert "405" in result.stderr
    assert _frontends_own(frontend) == before


def test_frontend_errors_come_back_as_kvctl_errors(frontend: Frontend) -> None:
    one_line_error(kvctl(frontend.url, "busy", "set", "-m", "nope", "--active-decode-blocks-threshold", "0.5",
                         "--yes"), 1, "Model 'nope' not found")
    one_line_error(kvctl(frontend.url, "busy", "get", "-m", "nope"), 1, f"models there: {MODEL}")
    one_line_error(kvctl(frontend.url, "busy", "set", "-m", MODEL, "--active-decode-blocks-threshold", "1.5",
                         "--yes"), 2, "active_decode_blocks_threshold must be a number in [0.0, 1.0]")
    assert _frontends_own(frontend) == OFF


BODIES: list[tuple[str, dict[str, str], bytes]] = [  # (what, headers, body): the cases docs/http-api.md lists
    ("not JSON content", {"content-type": "text/plain"}, b'{"model": "tiny"}'),
    ("no content type", {}, b'{"model": "tiny"}'),
    ("malformed JSON", {"content-type": "application/json"}, b'{"model": '),
    ("a negative token threshold", {"content-type": "application/json"},
     b'{"model": "tiny", "active_prefill_tokens_threshold": -1}'),
    ("a string for a number", {"content-type": "application/json"},
     b'{"model": "tiny", "active_decode_blocks_threshold": "high"}'),
    ("a decode fraction above 1", {"content-type": "application/json"},
     b'{"model": "tiny", "active_decode_blocks_threshold": 1.5}'),
    ("an unknown model", {"content-type": "application/json"},
     b'{"model": "nope", "active_prefill_tokens_threshold": 9}'),
    ("unknown fields, all null: a get", {"content-type": "application/json"}, b'{"model": "tiny", "color": "red"}'),
]


@pytest.mark.parametrize(("what", "headers", "body"), BODIES, ids=[b[0] for b in BODIES])
def test_kvctl_answers_busy_threshold_bodies_with_the_frontends_status(fleet: Fleet, frontend: Frontend, what: str,
                                                                      headers: dict[str, str], body: bytes) -> None:
    """kvctl's own `/busy_threshold` against the frontend's, body for body: the same status code (and for the
    unknown model, Dynamo's words)."""
    router = fleet.routers["nats"].url  # its model is `default` where the frontend's is `tiny`
    theirs = httpx.post(f"{frontend.url}/busy_threshold", content=body, headers=headers, timeout=10)
    ours = httpx.post(f"{router}/busy_threshold", content=body.replace(b'"tiny"', b'"default"'), headers=headers,
                      timeout=10)
    assert ours.status_code == theirs.status_code, f"{what}: kvctl {ours.text!r}, Dynamo {theirs.text!r}"
    if what == "an unknown model":
        assert ours.json()["error"] == theirs.json()["error"]  # kvctl also lists the models it knows
