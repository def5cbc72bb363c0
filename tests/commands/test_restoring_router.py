"""Clients of a router whose restart is still restoring its index (issue 27): one line each, never a
traceback; `route` exits 3 (as against the closed port a restore used to keep), `router status` says so on
top of its table, `doctor` gives the restore as its one finding."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

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
        status = kvctl(url, "router", "status")
        assert status.exit_code == 0 and "restoring the index: starting" in status.stderr, status.output
        doctor = kvctl(url, "doctor", "-o", "json")
        assert doctor.exit_code == CheckStatus.WARNING, doctor.output
        [finding] = json.loads(doctor.stdout)["findings"]
        assert finding["check"] == "restore" and "restoring its index" in finding["cause"]
