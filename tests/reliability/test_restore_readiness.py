"""A restart serves at once (issue 27): its port accepts before the state dir is restored, `/readyz` says
"restoring" (routes and dumps are refused, liveness answers) until the index is whole, then "ready" with
the index that was written."""

from __future__ import annotations

import random
import re
import socket
from pathlib import Path

import httpx
import pytest

from kvctl.core.events import RouterEvent, Stored
from kvctl.server.persistence.state_log import StateLog
from kvctl.server.state import Fleet
from tests.server.test_sd_notify import notify_path, receive  # noqa: F401 (notify_path: a fixture)
from tests.server.test_serve_process import _stop, serving
from tests.support.eventually import eventually
from tests.support.holding import holding

# ~300k (worker, block) pairs: a restore of many slices of the loop, most of it the log (an image is built in bulk,
# ~4x faster than the log's events are replayed); the test holds it at its end, however fast the machine
IMAGE_CHAINS, LOG_CHAINS, CHAIN = 1600, 3200, 64


def _chains(rng: random.Random, count: int) -> list[RouterEvent]:
    return [RouterEvent(1 + n % 16, Stored(None, [rng.getrandbits(63) for _ in range(CHAIN)],
                                           [rng.getrandbits(63) for _ in range(CHAIN)]), 0, n) for n in range(count)]


def _state_dir(path: Path) -> dict[str, int]:
    """An image of most chains, then a state log of the rest; the blocks each worker holds."""
    rng = random.Random(27)
    fleet = Fleet(block_size=16)
    fleet.add_model("default")
    fleet.apply("default", _chains(rng, IMAGE_CHAINS), 0.0)
    log = StateLog(path, fleet, restored_from=None)  # writes the image of the fleet so far, then logs
    for event in _chains(rng, LOG_CHAINS):
        fleet.apply_engine_batch("default", event.worker, [event.data], 0.0)
    log.close()
    return dict(fleet.stats().models["default"].workers)


def _workers(client: httpx.Client) -> dict[str, int]:
    return dict(client.get("/v1/tree/stats").json()["models"]["default"]["workers"])


def test_a_restart_answers_restoring_at_once_then_ready_with_the_index_written(
        tmp_path: Path, notify_path: tuple[socket.socket, str],  # noqa: F811 (the fixture imported)
        monkeypatch: pytest.MonkeyPatch) -> None:
    expected = _state_dir(tmp_path / "state")
    notify, value = notify_path
    monkeypatch.setenv("NOTIFY_SOCKET", value)  # systemd's side: READY=1 once whole, progress before
    gate = holding(monkeypatch, "RESTORE", tmp_path / "restored")  # "restoring" until the test has looked
    with serving(tmp_path / "state", ready=False) as (proc, client):
        first = client.get("/readyz")  # the port accepts: the restore has only begun
        assert first.status_code == 503 and first.json()["status"] == "restoring", first.text
        assert first.headers["retry-after"] == "1"
        route = client.post("/v1/route", json={"local_hashes": [1, 2, 3]})
        assert route.status_code == 503 and route.headers["retry-after"] == "1", route.text
        assert route.json()["error"].startswith("restoring the index: ") and route.json()["restoring"]["total"] > 0
        assert client.get("/v1/tree/stats").status_code == 503  # a partial index's stats would mislead
        assert client.get("/healthz").status_code == 200  # alive all along
        restoring_gauge = re.search(r"^kvctl_ready (\S+)$", client.get("/metrics").text, re.M)
        assert client.get("/v1/status").json()["readiness"]["status"] == "restoring"
        gate.touch()
        ready = eventually(lambda: client.get("/readyz"), "the index whole", until=lambda r: r.status_code == 200,
                           timeout=60)
        assert ready.json()["status"] == "ready" and ready.json()["restore_s"] > 0
        # the gauge the KvctlRestoring alert reads: 0 while restoring, then 1
        assert restoring_gauge is not None and float(restoring_gauge[1]) == 0.0
        assert re.search(r"^kvctl_ready 1\.0$", client.get("/metrics").text, re.M)
        told = receive(notify)
        assert "READY" not in told and told["STATUS"].startswith("restoring the index: "), told
        while "READY" not in told:
            told = receive(notify)
        assert told["STATUS"].startswith(f"serving {client.base_url}, ")
        assert _workers(client) == expected
        assert client.post("/v1/route", json={"local_hashes": [1, 2, 3]}).status_code == 200
        _stop(proc)
