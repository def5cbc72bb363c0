"""A route body that opens with its token ids is read in one pass; every body must read exactly as it does
whole (msgspec for the object, the C reader for the ids): the same request, the same ids, the same error."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvctl.server.http import bodies as body_module
from kvctl.server.http.bodies import read_route_body, read_route_body_whole

pytestmark = pytest.mark.usefixtures("native_impl")  # on the C extension and on its pure-Python twin

_WS = st.sampled_from(["", " ", "\n", "\t ", "\r\n  "])
_TOKEN = st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 40), st.sampled_from(
    ["-1", "-0", "4294967296", "1.5", "1e3", "01", '"7"', "null", "true", "[]", ""]))
_MEMBER = st.one_of(
    st.sampled_from(['"model":"m"', '"model":7', '"request_id":"r"', '"reserve":true', '"explain":false',
                     '"lora_name":null', '"cache_salt":"s"', '"temperature":0.5', '"overlap_score_weight":-1',
                     '"unknown":1',
                     '"token_ids":null', '"token_ids":[9,8]', '"local_hashes":[1,2]', '"model":"\\u00e9"']),
    st.builds(lambda k: json.dumps(k) + ":1", st.text(max_size=6)))


def _outcome(read: object, raw: bytes) -> object:
    try:
        body, ids = read(raw)  # type: ignore[operator]
    except (msgspec.DecodeError, ValueError) as exc:
        return ("error", type(exc).__name__, str(exc))
    return ("ok", msgspec.structs.asdict(body) | {"token_ids": None}, None if ids is None else ids.tolist())


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    ws = lambda: draw(_WS)  # noqa: E731
    tokens = draw(st.lists(_TOKEN, max_size=6))
    array = "[" + ws() + ("," + ws()).join(str(t) for t in tokens) + ws() + "]"
    before = draw(st.lists(_MEMBER, max_size=2))
    after = draw(st.lists(_MEMBER, max_size=3))
    members = [*before, ws() + '"token_ids"' + ws() + ":" + ws() + array, *after]
    text = ws() + "{" + ws() + ("," + ws()).join(members) + ws() + draw(st.sampled_from(["}", ",}", "", "} x", "}}"]))
    return text.encode() + draw(st.sampled_from([b"", b" \n", b"\xff"]))


@pytest.mark.slow
@settings(max_examples=1500, deadline=None)
@given(bodies())
@example(b'{"token_ids":[1,2,3]}')
@example(b'{"token_ids":[1,2],"model":"m","token_ids":null}')
@example(b'{"token_ids":[1,2],}')
@example(b'{"token_ids":[1,-2],"model":"m"}')
@example(b'{"token_ids":[1],"model":"\xff"}')
def test_the_one_pass_reading_agrees_with_the_whole(raw: bytes) -> None:
    assert _outcome(read_route_body, raw) == _outcome(read_route_body_whole, raw)


def test_the_common_body_takes_the_one_pass_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    """What clients send is not read whole (the point of the one-pass reading): the whole reading is never asked."""

    def whole(raw: bytes) -> object:
        raise AssertionError("read whole")

    monkeypatch.setattr(body_module, "read_route_body_whole", whole)
    body, ids = read_route_body(json.dumps({"token_ids": list(range(40)), "model": "m", "request_id": "r"}).encode())
    assert (body.model, body.request_id, ids.tolist() if ids is not None else None) == ("m", "r", list(range(40)))
