"""Both router clients against a real router, its routes on each path (the fast path, the ASGI app): the sync one
against a `kvctl serve` process, the async one against the same app served in the test's loop. Each answer the
router can give becomes the same error class with the router's own message, and a silent or absent router becomes
a timeout or `Unreachable` naming the URL."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest

from kvctl import http_api as api
from kvctl.client import AsyncRouterClient, RouterClient, calls
from kvctl.client._base import Call
from kvctl.errors import AllBusy, ApiError, KvctlError, NotFound, Refused, TimedOut, Unreachable
from kvctl.exit_codes import ExitCode
from kvctl.server.http.api import create_app
from kvctl.server.state import Fleet
from tests.nats_server import free_port
from tests.server.test_serve_process import serving
from tests.support.served import served

Send = Callable[[Call], Awaitable[Any]]


@pytest.fixture(scope="module")
def router_url(module_route_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One `kvctl serve` for the module: each test uses a model of its own, or none (`default` keeps no worker)."""
    with serving(tmp_path_factory.mktemp("router"), "--no-restore") as (_, client):
        yield str(client.base_url).rstrip("/")


@pytest.fixture(params=["sync", "async"])
async def send(request: pytest.FixtureRequest, module_route_path: str) -> AsyncIterator[Send]:
    if request.param == "sync":
        with RouterClient(request.getfixturevalue("router_url")) as client:
            async def send_sync(call: Call) -> Any:
                return client.send(call)

            yield send_sync
    else:
        async with served(create_app(Fleet()), module_route_path) as app_client, \
                AsyncRouterClient(str(app_client.base_url)) as aclient:
            yield aclient.send


async def test_an_answer_decodes(send: Send) -> None:
    row = await send(calls.register_worker(7, model="decodes"))
    assert type(row) is api.Worker and (row.worker_id, row.model) == (7, "decodes")
    decision = await send(calls.route(token_ids=list(range(32)), model="decodes"))
    assert type(decision) is api.Decision and decision.worker_id == 7


async def test_an_unknown_model_is_not_found_and_the_hint_names_the_routers_models(send: Send) -> None:
    with pytest.raises(NotFound) as caught:
        await send(calls.route(token_ids=[1, 2], model="nope"))
    assert caught.value.status == 404 and "unknown model 'nope'" in caught.value.message
    assert caught.value.hint is not None and caught.value.hint.startswith("models there: ")
    assert "default" in caught.value.hint


async def test_a_model_without_workers_is_refused_not_busy(send: Send) -> None:
    with pytest.raises(Refused) as caught:
        await send(calls.route(token_ids=[1, 2]))
    assert type(caught.value) is Refused and caught.value.status == 503
    assert caught.value.message.startswith("POST /v1/route: model 'default' has no workers to route to; ")


async def test_every_worker_over_a_threshold_is_all_busy(send: Send) -> None:
    await send(calls.register_worker(1, model="busy"))
    await send(calls.set_busy_thresholds("busy", {"active_prefill_tokens_threshold": 1}))
    await send(calls.route(token_ids=list(range(64)), model="busy", reserve=True, request_id="first"))
    with pytest.raises(AllBusy, match=r"every worker of model 'busy' is busy .* \(HTTP 503\)"):
        await send(calls.route(token_ids=list(range(64)), model="busy"))


async def test_a_bad_value_is_an_api_error_with_the_routers_message(send: Send) -> None:
    with pytest.raises(ApiError) as caught:
        await send(calls.set_busy_thresholds("default", {"active_decode_blocks_threshold": 3.0}))
    assert caught.value.status == 400 and "must be a number in [0.0, 1.0]" in caught.value.message


async def test_a_body_of_the_wrong_shape_is_a_422_naming_the_field(send: Send) -> None:
    with pytest.raises(ApiError) as caught:
        await send(calls.register_worker(-1))
    assert caught.value.status == 422 and "worker_id" in caught.value.message


async def test_without_the_admin_token_the_hint_says_how_to_pass_it() -> None:
    transport = httpx.ASGITransport(app=create_app(Fleet(), admin_token="s3cret"))
    async with AsyncRouterClient("http://router", transport=transport) as client:
        with pytest.raises(ApiError) as caught:
            await client.send(calls.register_worker(1))
    assert caught.value.status == 401 and caught.value.hint is not None and "--token" in caught.value.hint
    async with AsyncRouterClient("http://router", transport=transport, token="stale") as client:
        with pytest.raises(ApiError) as caught:  # a wrong token is told apart from a missing one (issue 37)
            await client.send(calls.register_worker(1))
    assert "the admin token sent is not this router's" in caught.value.message
    assert caught.value.hint is not None and "is not the router's --admin-token" in caught.value.hint
    async with AsyncRouterClient("http://router", transport=transport, token="s3cret") as client:
        assert (await client.send(calls.register_worker(1))).worker_id == 1


@pytest.fixture
def silent() -> Iterator[str]:
    """A port whose connections the kernel accepts and nobody ever answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_sync_a_router_that_never_answers_is_a_timeout(silent: str) -> None:
    with RouterClient(silent, timeout=0.3) as client, pytest.raises(KvctlError) as caught:
        client.send(calls.status())
    assert type(caught.value) is TimedOut and caught.value.message == f"{silent} did not answer in time"


async def test_async_a_router_that_never_answers_is_a_timeout(silent: str) -> None:
    async with AsyncRouterClient(silent, timeout=0.3) as client:
        with pytest.raises(KvctlError) as caught:
            await client.send(calls.status())
    assert type(caught.value) is TimedOut and caught.value.message == f"{silent} did not answer in time"


def test_sync_an_unreachable_url_is_unreachable_naming_it() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with RouterClient(url) as client, pytest.raises(Unreachable) as caught:
        client.send(calls.status())
    assert caught.value.message.startswith(f"cannot reach the router at {url}: ")
    assert caught.value.exit_code == ExitCode.UNREACHABLE


async def test_async_an_unreachable_url_is_unreachable_naming_it() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    async with AsyncRouterClient(url) as client:
        with pytest.raises(Unreachable) as caught:
            await client.send(calls.status())
    assert caught.value.message.startswith(f"cannot reach the router at {url}: ")
    assert caught.value.exit_code == ExitCode.UNREACHABLE
