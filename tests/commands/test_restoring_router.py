"""Clients of a router whose restart is still restoring its index (issue 27): one line each, never a
traceback; `route` exits 3 (as against the closed port a restore used to keep), what is still answered
(`router status`, `workers`, `busy get`) comes with one warning from the router's `Warning` header, `top`
says "restoring" in its header, `doctor` gives the restore as its one finding."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from kvctl.client._base import warning_of
from kvctl.exit_codes import CheckStatus, ExitCode
from kvctl.server.http.api import create_app, http_protocol
from kvctl.server.listen import base_url, bind
from kvctl.server.readiness import Readiness
from kvctl.server.state import Fleet
from tests.commands.live_router import kvctl
from tests.support.eventually import eventually


@contextmanager
def restoring_router() -> Iterator[str]:
    """A router app that stays "restoring" (nothing finishes its restore), served from a thread of its own."""
    app = create_app(Fleet(block_size=16), readiness=Readiness(restoring=True))
    server = uvicorn.Server(uvicorn.Config(app, http=http_protocol(app), log_config=None, lifespan="off"))
    sock = bind("127.0.0.1", 0)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        eventually(lambda: server.started, "uvicorn to start")
        yield base_url(sock)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_clients_of_a_restoring_router_say_so_in_one_line() -> None:
    with restoring_router() as url:
        route = kvctl(url, "route", "--local-hashes", "1,2,3")
        assert route.exit_code == ExitCode.UNREACHABLE, route.output
        assert "restoring the index: starting" in route.stderr and "Traceback" not in route.output
        assert "GET /readyz" in route.stderr
        for command in (["router", "status"], ["workers"], ["busy", "get"], ["workers", "-o", "json"]):
            answered = kvctl(url, *command)
            assert answered.exit_code == 0, answered.output
            warnings = [line for line in answered.stderr.splitlines() if line.startswith("warning: ")]
            assert len(warnings) == 1, answered.stderr  # once, however many calls the command made
            assert warnings[0].startswith("warning: restoring the index: starting"), warnings
            assert "answers show part of the index" in warnings[0]
        top = kvctl(url, "top", "--once", "-o", "json")
        assert top.exit_code == 0 and json.loads(top.stdout)["restoring"] == "starting, 0.0%", top.output
        assert "restoring  starting, 0.0%" in kvctl(url, "top", "--once").stdout
        doctor = kvctl(url, "doctor", "-o", "json")
        assert doctor.exit_code == CheckStatus.WARNING, doctor.output
        [finding] = json.loads(doctor.stdout)["findings"]
        assert finding["check"] == "restore" and "restoring its index" in finding["cause"]


def test_a_client_passes_on_the_restore_warning_once() -> None:
    from kvctl.client import RouterClient, calls

    warned: list[str] = []
    with restoring_router() as url, RouterClient(url, warn=warned.append) as client:
        client.send(calls.workers())
        client.send(calls.status())
        assert len(warned) == 1 and warned[0].startswith("restoring the index: starting"), warned


@pytest.mark.parametrize("header", ['299 kvctl "restoring the index"', '299 - "restoring"', '199 kvctl "x"',
                                    "299 kvctl restoring", '299 kvctl "', ""])
def test_only_a_routers_own_warning_header_is_read(header: str) -> None:
    response = httpx.Response(200, headers={"warning": header} if header else {})
    expected = "restoring the index" if header == '299 kvctl "restoring the index"' else None
    assert warning_of(response) == expected
