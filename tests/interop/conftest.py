"""The interop tier: a real Dynamo 1.6.1 fleet (tests/interop/fleet.py), started once for this package's tests
and stopped after its last one (not at the end of the session: the rest of the suite runs without it).

Every test here is marked `interop`. Without Dynamo's venv the tests skip, saying why; with
KVCTL_REQUIRE_INTEROP=1 (CI) they fail instead, so CI cannot pass with the tier skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.interop.fleet import Fleet, dynamo_python, start_fleet, wait_until
from tests.nats_server import NatsServer

HERE = Path(__file__).parent
NATS_ROUTER = "nats"
NATS_ROUTER_ID = 4242


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.interop)


@pytest.fixture(scope="session")
def dynamo() -> Path:
    """The Dynamo venv's python (skips, or fails under KVCTL_REQUIRE_INTEROP=1, when there is none)."""
    return dynamo_python()


@pytest.fixture(scope="package")
def nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A real nats-server with JetStream: the fleet's event plane."""
    server = NatsServer(tmp_path_factory.mktemp("interop-nats"))
    yield server
    server.stop()


@pytest.fixture(scope="package")
def fleet(dynamo: Path, nats: NatsServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Three mockers on the NATS event plane (namespace dynamo, component backend, endpoint generate, model
    `tiny`, block size 16, 128 KV blocks each), Dynamo's frontend with its KV router, Dynamo's indexer
    (`--threads 1`) and `kvctl serve` both on the mockers' ZMQ streams, joined before any request was made:
    whenever the fleet is quiet, the indexer and kvctl must hold the same index. A second `kvctl serve`
    (`fleet.routers[NATS_ROUTER]`) follows the fleet's NATS event plane with replica sync. Process logs are in
    `fleet.workdir`. Tests may add load (`shared_prefix_load`) but must not stop its processes. A router that
    must see the whole history (a kvctl following the NATS plane, say) goes in `start_fleet(routers=...)` here."""
    started = start_fleet(tmp_path_factory.mktemp("interop-fleet"), dynamo, mockers=3, nats_url=nats.url,
                          routers={NATS_ROUTER: ["--nats", nats.url, "--namespace", "dynamo", "--replica-sync",
                                                 "--router-id", str(NATS_ROUTER_ID)]})
    router = started.routers[NATS_ROUTER]
    try:  # subscribed before any request: the NATS plane, like ZMQ, keeps no history
        wait_until(lambda: httpx.get(f"{router.url}/v1/status", timeout=5).json()["event_plane"]["ready"] or None,
                   "kvctl subscribed to the NATS event plane", timeout=30, procs=[router.proc])
    except BaseException:
        started.stop()
        raise
    yield started
    started.stop()
