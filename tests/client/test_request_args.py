"""The clients encode bodies with msgspec (speed), and must send exactly what the stdlib would have sent."""

from __future__ import annotations

import json

import httpx
import pytest

from kvctl.client import calls
from kvctl.client._base import interpret, request_args
from kvctl.errors import KvctlError


def test_route_body_is_the_json_of_the_call() -> None:
    call = calls.route(token_ids=list(range(2176)), model="m", request_id="r-1", reserve=True)
    args = request_args(call)
    assert args["headers"]["content-type"] == "application/json"
    assert json.loads(args["content"]) == call.json == {
        "model": "m", "reserve": True, "explain": False, "token_ids": list(range(2176)), "request_id": "r-1"}


def test_a_call_without_body_sends_only_its_query() -> None:
    assert request_args(calls.free("r-1", "m")) == {"params": {"model": "m"}}


@pytest.mark.parametrize(("content", "expected"), [(b'{"worker_id": 3}', {"worker_id": 3}), (b"", None)])
def test_answers_decode(content: bytes, expected: object) -> None:
    assert interpret(calls.status(), httpx.Response(200, content=content)) == expected


@pytest.mark.parametrize("content", [b"<html>proxy</html>", b"[" * 100_000])
def test_an_answer_that_is_not_json_says_so(content: bytes) -> None:
    with pytest.raises(KvctlError, match="the answer is not JSON"):
        interpret(calls.status(), httpx.Response(200, content=content))


def test_prefill_complete_carries_the_engines_cached_tokens_only_when_known() -> None:
    assert json.loads(request_args(calls.prefill_complete("r-1", "m", 96))["content"]) == {"cached_tokens": 96}
    assert request_args(calls.prefill_complete("r-1", "m")) == {"params": {"model": "m"}}
