"""A Dynamo 1.6.1 fleet whose mockers serve their own `/metrics` (Dynamo's system status server), for the tiers
tests and for capturing tests/fixtures/dynamo-1.6.1-fleet/metrics.

The interop package's shared fleet (tests/interop/conftest.py) cannot be used for this: its mockers run without
a system status server, and a test may not change that fleet. This one is small: mockers on Dynamo's ZMQ event
plane (no NATS), Dynamo's frontend with its KV router, no indexer, no `kvctl serve`.

A mocker serves its metrics when `DYN_SYSTEM_PORT` is set (`DYN_SYSTEM_HOST` says where it binds). Dynamo 1.6.1
parses the port as an i16: a port above 32767 is refused at start (`invalid value ... expected i16 for key
"SYSTEM_PORT"`), so the port is picked below that. The frontend serves `/metrics` on its HTTP port.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tests.interop.fleet import NAMESPACE, START_S, Fleet, Mocker, free_port, wait_until, write_model_dir


@dataclass
class StatusFleet(Fleet):
    """A `Fleet` whose mockers serve `/metrics` on a system port of their own (by their request-plane port)."""

    system_ports: dict[int, int] = field(default_factory=dict)

    def env(self, **extra: str) -> dict[str, str]:
        if "DYN_TCP_RPC_PORT" in extra:  # a mocker's environment: its request-plane port names it
            port = self.system_ports.setdefault(int(extra["DYN_TCP_RPC_PORT"]), free_port())
            extra = {**extra, "DYN_SYSTEM_PORT": str(port), "DYN_SYSTEM_HOST": "127.0.0.1"}
        return super().env(**extra)

    def metrics_url(self, mocker: Mocker) -> str:
        return f"http://127.0.0.1:{self.system_ports[mocker.rpc_port]}/metrics"


def start_status_fleet(workdir: Path, python: Path, *, mockers: int = 1) -> StatusFleet:
    """Mockers and a frontend, each ready (a mocker's `/metrics` answering); on failure stop what started."""
    import httpx

    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "home").mkdir(exist_ok=True)
    fleet = StatusFleet(workdir=workdir, python=python, nats_url=None, namespace=NAMESPACE,
                        model_dir=write_model_dir(workdir / "model"))
    try:
        for _ in range(mockers):
            fleet.start_mocker()
        for mocker in fleet.mockers:
            fleet.await_mocker(mocker)
            url = fleet.metrics_url(mocker)
            wait_until(lambda url=url: httpx.get(url, timeout=5).status_code == 200,  # type: ignore[misc]
                       f"{mocker.proc.name} serving {url}", timeout=START_S, procs=[mocker.proc])
        frontend = fleet.start_frontend()
        fleet.await_frontend(frontend)
    except BaseException:
        fleet.stop()
        raise
    return fleet
