"""The clients encode bodies with msgspec (speed), and must send exactly what the stdlib would have sent."""

from __future__ import annotations

import json

import httpx
import msgspec
import pytest

from kvctl import http_api as api
from kvctl.client import calls
from kvctl.client._base import interpret, request_args
from kvctl.errors import ApiError, KvctlError
from kvctl.exit_codes import ExitCode


def test_route_body_is_the_json_of_the_call() -> None:
    call = calls.route(token_ids=list(range(2176)), model="m", request_id="r-1", reserve=True)
    args = request_args(call)
    assert args["headers"]["content-type"] == "application/json"
    assert json.loads(args["content"]) == call.json == {
        "model": "m", "reserve": True, "explain": False, "token_ids": list(range(2176)), "request_id": "r-1"}


def test_a_call_without_body_sends_only_its_query() -> None:
    assert request_args(calls.free("r-1", "m")) == {"params": {"model": "m"}}


DECISION = api.Decision(2**63 + 7, 1, 3, 4, "r-1", "lowest_logit")


def test_an_answer_decodes_into_the_struct_the_router_encoded_it_from() -> None:
    answer = interpret(calls.route(token_ids=[1]), httpx.Response(200, content=msgspec.json.encode(DECISION)))
    assert type(answer) is api.Decision and answer == DECISION  # u64 ids exact, past 2^53


@pytest.mark.parametrize("content", [b'{"worker_id": 3}', b'{"worker_id": "3", "dp_rank": 0, "overlap_blocks": 0, '
                                     b'"required_blocks": 0, "request_id": null, "reason": "x"}', b"[]",
                                     b"[" * 100_000])
def test_an_answer_of_another_shape_is_an_error_naming_the_call_and_what_is_wrong(content: bytes) -> None:
    """What a router of another version might answer: an error of the tree (one line, exit 1), no traceback."""
    with pytest.raises(KvctlError) as caught:
        interpret(calls.route(token_ids=[1]), httpx.Response(200, content=content))
    assert type(caught.value) is KvctlError and caught.value.exit_code == ExitCode.ERROR
    assert caught.value.message.startswith("POST /v1/route: the router's answer is not what kvctl ")
    assert caught.value.hint is not None and "another version" in caught.value.hint


@pytest.mark.parametrize("content", [b"<html>proxy</html>", b'{"worker_id": 3', b""])
def test_an_answer_that_is_not_json_says_so(content: bytes) -> None:
    with pytest.raises(KvctlError, match="the answer is not JSON"):
        interpret(calls.status(), httpx.Response(200, content=content))


def test_a_422_names_each_invalid_field() -> None:
    invalid = api.Invalid([api.InvalidField("missing", ["body", "worker_id"], "Field required"),
                           api.InvalidField("int_type", ["query", "dp_rank", 0], "Input should be an integer")])
    with pytest.raises(ApiError) as caught:
        interpret(calls.status(), httpx.Response(422, content=msgspec.json.encode(invalid)))
    assert caught.value.message == ("GET /v1/status: body.worker_id: Field required; query.dp_rank.0: Input should "
                                    "be an integer (HTTP 422)")


def test_an_error_of_another_server_is_its_status() -> None:
    with pytest.raises(ApiError) as caught:
        interpret(calls.status(), httpx.Response(502, content=b'{"message": "upstream down"}'))
    assert caught.value.message == "GET /v1/status: Bad Gateway (HTTP 502)"


def test_prefill_complete_carries_the_engines_cached_tokens_only_when_known() -> None:
    assert json.loads(request_args(calls.prefill_complete("r-1", "m", 96))["content"]) == {"cached_tokens": 96}
    assert request_args(calls.prefill_complete("r-1", "m")) == {"params": {"model": "m"}}
