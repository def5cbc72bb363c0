"""The health ledger (issue 36): a loss or a part that is down shows in /readyz, /v1/status, /metrics and doctor."""

from __future__ import annotations

from kvctl.core.doctor.checks import diagnose
from kvctl.core.doctor.findings import Severity
from kvctl.server.http.api import create_app
from kvctl.server.state import Fleet
from kvctl.server.worker_info import WorkerInfo
from tests.support.served import served


async def test_a_fault_and_a_loss_show_in_all_four_places() -> None:
    fleet = Fleet()
    fleet.register(WorkerInfo(1, 0, "default"))
    async with served(create_app(fleet), "asgi") as client:
        assert (await client.get("/readyz")).json()["status"] == "ready"

        fleet.health.lose("zmq", "too_large", 3, detail="a 300 MiB frame from tcp://h:1", fix="raise --max-frame")
        fleet.health.fail("state_dir", "restored 80,000 of 96,000 blocks", "see the runbook")
        ready = await client.get("/readyz")
        assert ready.status_code == 200
        assert ready.json()["status"] == "partial"
        assert ready.json()["faults"] == ["state_dir: restored 80,000 of 96,000 blocks"]

        fleet.health.fail("plane", "discovery has died", "check etcd", blocks=True)
        ready = await client.get("/readyz")
        assert (ready.status_code, ready.json()["status"]) == (503, "degraded")

        metrics = (await client.get("/metrics")).text
        assert 'kvctl_input_lost_total{cause="too_large",surface="zmq"} 3.0' in metrics
        assert 'kvctl_part_down{blocks_ready="true",part="plane"} 1.0' in metrics

        status = (await client.get("/v1/status")).json()
        assert status["health"]["losses"][0]["count"] == 3
        findings = {f.check: f for f in diagnose(status, (await client.get("/v1/workers")).json()["workers"], [])}
        assert findings["part:plane"].severity is Severity.CRITICAL
        assert findings["part:state_dir"].severity is Severity.WARNING
        assert findings["lost:zmq"].severity is Severity.WARNING
        assert findings["lost:zmq"].next_step == "raise --max-frame"

        fleet.health.recover("plane")
        assert (await client.get("/readyz")).status_code == 200
