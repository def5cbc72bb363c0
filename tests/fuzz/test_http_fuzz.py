"""Hostile request bodies on every operation of the router's HTTP API that can take one, served in-process on
each route path.

The operations are read from the app's own OpenAPI document (so an endpoint added later is fuzzed too), and
each gets random bytes, random JSON (NaN/Infinity literals, ints past 2^64, negatives), objects with the
right keys and wrong types, deep nesting, chunked bodies and bodies over the size cap. The app must never
answer 5xx (nor raise), every 4xx must say what is wrong, and /healthz must still answer afterwards.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvctl.core.events.dynamo import decode_router_event_json
from kvctl.server.http.api import create_app, openapi_document
from kvctl.server.ingest.streams import Streams
from kvctl.server.state import Fleet
from kvctl.server.worker_info import WorkerInfo
from tests.fixtures_path import FIXTURES
from tests.fuzz.junk import DEPTHS, JSON_JUNK, JSON_SCALARS, NAMES, Blob, deep_json, hostile
from tests.support.served import served

MAX_BODY = 1 << 20
DUMP_LINES = (FIXTURES / "dynamo-1.6.1" / "dump.jsonl").read_text().splitlines()
BODY_METHODS = ("post", "put", "patch")


def _app() -> Any:
    fleet = Fleet(block_size=16, seed=0)
    fleet.apply("default", [decode_router_event_json(line) for line in DUMP_LINES], 0.0)
    fleet.register(WorkerInfo(1, 0, "default"))
    return create_app(fleet, max_body_bytes=MAX_BODY)


def _operations() -> list[tuple[str, str, list[str]]]:
    """(method, path, the keys its documented body has) of every operation that takes a body."""
    document = openapi_document()
    out = []
    for path, item in sorted(document["paths"].items()):
        for method, operation in sorted(item.items()):
            if method in BODY_METHODS:
                content = operation.get("requestBody", {}).get("content", {})
                schema = content.get("application/json", {}).get("schema", {})
                while "$ref" in schema:  # a JSON pointer into the document
                    target = document
                    for part in schema_ref(schema["$ref"]):
                        target = target[part]
                    schema = target
                out.append((method.upper(), path, sorted(schema.get("properties", {}))))
    return out


def schema_ref(ref: str) -> list[str]:
    assert ref.startswith("#/"), ref
    return ref[2:].split("/")


OPERATIONS = _operations()
ALL_KEYS = sorted({key for _, _, keys in OPERATIONS for key in keys} | {
    "model", "active_decode_blocks_threshold", "active_prefill_tokens_threshold",
    "active_prefill_tokens_threshold_frac"})  # /busy_threshold reads its body itself

_json_text = JSON_JUNK.map(lambda v: json.dumps(v).encode())  # Python's json writes NaN, Infinity, any int
_mutated_events = hostile([line.encode() for line in DUMP_LINES], json.loads, lambda v: json.dumps(v).encode(),
                          JSON_JUNK)


@st.composite
def bodies(draw: st.DrawFn, keys: list[str]) -> bytes:
    kind = draw(st.sampled_from(["bytes", "json", "keys", "events", "deep", "huge"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "json":
        return draw(_json_text)
    if kind == "keys":  # the right keys (this operation's, or any operation's), values of any type
        names = st.sampled_from(keys or ALL_KEYS) | st.sampled_from(ALL_KEYS) | NAMES
        obj = draw(st.dictionaries(names, JSON_SCALARS | JSON_JUNK, min_size=1, max_size=6))
        return json.dumps(obj).encode()
    if kind == "events":  # real RouterEvents, mutated
        return draw(_mutated_events)
    if kind == "deep":
        return deep_json(draw(DEPTHS), draw(st.sampled_from(["array", "map"])))
    return b"[" + b"0," * (MAX_BODY // 2) + b"0]"  # over the cap


CONTENT_TYPES = st.sampled_from([None, "application/json", "application/x-ndjson", "text/plain",
                                 "application/json; charset=latin-1", "multipart/form-data"])
PATH_VALUES = st.sampled_from(["1", "0", "-1", "18446744073709551616", "x", "%00", "r%2F1"])


@pytest.fixture
async def client(route_path: str) -> AsyncIterator[httpx.AsyncClient]:
    """The app served on each route path: a hostile route body must get the same 4xx on both."""
    async with served(_app(), route_path) as c:
        yield c


def _says_what_is_wrong(response: httpx.Response) -> None:
    body = response.json()
    assert isinstance(body, dict), body
    message = body.get("error") or body.get("detail")
    assert message, body
    if isinstance(message, list):  # an invalid body or query: each item names where and what
        assert all(item.get("loc") and item.get("msg") for item in message), message


def test_every_operation_that_takes_a_body_is_fuzzed() -> None:
    found = {(method, path) for method, path, _ in OPERATIONS}
    assert {("POST", "/v1/workers"), ("POST", "/v1/events"), ("POST", "/v1/route"), ("POST", "/v1/reset"),
            ("POST", "/busy_threshold")} <= found, found


async def _chunks(body: bytes) -> AsyncIterator[bytes]:
    for at in range(0, len(body), 65536):
        yield body[at:at + 65536]
    if not body:
        yield b""


# The app is shared by every example on purpose: state left by one body (a worker, thresholds) is the
# ground the next one lands on.
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(OPERATIONS).flatmap(lambda op: st.tuples(st.just(op), bodies(op[2]))), CONTENT_TYPES,
       PATH_VALUES, st.booleans())
@example((("POST", "/v1/events", []), b"[" * 100_000), "application/json", "1", False)
@example((("POST", "/v1/events", []), b"[" * 100_000), "application/x-ndjson", "1", False)
@example((("POST", "/v1/events", []), b'[null, 5, "x", [], {}]'), "application/json", "1", False)
@example((("POST", "/v1/events", []), b'null\n5\n"{}"'), "application/x-ndjson", "1", False)
@example((("POST", "/v1/workers", ["worker_id"]), b'{"worker_id": NaN}'), "application/json", "1", False)
@example((("POST", "/v1/route", ["model"]), b'{"model": "\x80"}'), "application/json", "1", False)
@example((("POST", "/busy_threshold", ["model"]), b'{"model": "\x80"}'), "application/json", "1", False)
@example((("POST", "/v1/workers", ["endpoint"]), b'{"worker_id": 1, "endpoint": "garbage"}'), None, "1", False)
@example((("POST", "/v1/reset", ["model"]), b'{"model": "x", "bogus": Infinity}'), "application/json", "1", False)
@example((("POST", "/v1/workers", ["worker_id"]), b'{"worker_id": 1, "model": 1e400}'), "application/json", "1",
         True)
async def test_no_body_makes_a_5xx(client: httpx.AsyncClient, case: tuple[tuple[str, str, list[str]], bytes],
                                   content_type: str | None, path_value: str, chunked: bool) -> None:
    (method, path, _), body = case
    url = re.sub(r"\{[^}]+\}", path_value, path)
    headers = {"content-type": content_type} if content_type else {}
    content: Any = _chunks(bytes(body)) if chunked else Blob(body)
    response = await client.request(method, url, content=content, headers=headers)
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        _says_what_is_wrong(response)
    if len(body) > MAX_BODY:
        assert response.status_code == 413
    health = await client.get("/healthz")
    assert health.status_code == 200 and health.json()["status"] == "ok"


_HOSTS = st.sampled_from(["127.0.0.1", "[::1]", "localhost", "*", "", "ü", "a b", "-", "10.0.0.1;127.0.0.1"])
ENDPOINTS = (
    st.text(max_size=30)
    | st.builds(lambda host, port: f"tcp://{host}:{port}", _HOSTS, st.integers(-1, 70_000) | st.just(5557))
    | st.sampled_from(["ipc://", "ipc://@", "inproc://kvctl-fuzz", "ipc:///tmp/kvctl-fuzz-" + "a" * 200,
                       "tcp://127.0.0.1:5557 ", "tcp://127.0.0.1", "udp://127.0.0.1:5557", ""])
)


@pytest.fixture
async def streaming() -> AsyncIterator[tuple[httpx.AsyncClient, Streams]]:
    """An app whose registrations start real engine streams (ZMQ SUB sockets), as `kvctl serve` runs it."""
    fleet = Fleet(block_size=16, seed=0)
    streams = Streams(fleet)
    app = create_app(fleet, streams=streams)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvctl") as c:
            yield c, streams
    finally:
        await streams.close()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ENDPOINTS, st.none() | ENDPOINTS)
@example("garbage", None)
@example("tcp://127.0.0.1:5557", "")
async def test_a_registered_endpoint_never_kills_its_stream(
        streaming: tuple[httpx.AsyncClient, Streams], endpoint: str, replay: str | None) -> None:
    """Either the registration is refused (422, naming the field) or the engine stream it starts keeps running:
    libzmq refusing the endpoint inside the stream's task would leave a dead stream behind a 201."""
    client, streams = streaming
    body = {"worker_id": 1, "endpoint": endpoint, "replay_endpoint": replay}
    response = await client.post("/v1/workers", json=body)
    assert response.status_code in (201, 422), response.text
    if response.status_code == 422:
        assert {tuple(e["loc"])[-1] for e in response.json()["detail"]} <= {"endpoint", "replay_endpoint"}
        return
    await asyncio.sleep(0)  # one loop pass: the stream's task connects its sockets before its first wait
    [source] = streams._running.values()  # noqa: SLF001 - the task is the thing under test
    assert source.task is not None and not source.task.done() and not source.failed, \
        "the engine stream stopped right after its registration was accepted"
    assert (await client.delete("/v1/workers/1")).status_code == 200
