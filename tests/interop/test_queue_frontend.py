"""A Dynamo 1.6.1 frontend that queues (issue 38): two mockers in real time (`--speedup-ratio 1`) behind a frontend
with `--router-queue-threshold 0.0 --router-queue-policy wspt`, overloaded. kvctl serve does not queue, and a
router following the fleet showed idle workers and an OK doctor while the frontend held requests for seconds;
`doctor --metrics FRONTEND/metrics` now names the queue, and says when it is empty again. A router given the
frontend's queue flags, and its in-flight requests by replica sync, says of its routes that the frontend would
queue them."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.commands.live_router import kvctl
from tests.doctor.rig import doctor, findings
from tests.interop.fleet import Fleet, start_fleet, wait_until, words

ROUTER = "following"
QUEUE = ["--router-queue-threshold", "0.0", "--router-queue-policy", "wspt"]


@pytest.fixture(scope="module")
def queueing(dynamo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    workdir = tmp_path_factory.mktemp("interop-queue")
    plane = ["--dynamo-discovery", f"file:{workdir / 'discovery'}", "--namespace", "dynamo", "--replica-sync",
             "--shadow", *QUEUE]
    started = start_fleet(workdir, dynamo, mockers=2, indexer=False, kvctl=False, routers={ROUTER: plane},
                          mocker_args=["--speedup-ratio", "1"], frontend_args=[*QUEUE, "--router-replica-sync"])
    try:
        yield started
    finally:
        started.stop()


def _queue(fleet: Fleet) -> dict[str, Any]:
    _, report = doctor(fleet.routers[ROUTER].url, "--metrics", f"{fleet.frontend_url}/metrics")
    return findings(report, "frontend_queue")[0]


def _route(fleet: Fleet) -> dict[str, Any]:
    body = {"model": fleet.model, "token_ids": list(range(64))}
    answer = httpx.post(f"{fleet.routers[ROUTER].url}/v1/route", json=body, timeout=10)
    return answer.raise_for_status().json()


def _placed(fleet: Fleet) -> tuple[int, str] | None:
    """`kvctl route --metrics FRONTEND`: the requests of its class the frontend holds, while it holds some."""
    shown = kvctl(fleet.routers[ROUTER].url, "route", "-m", fleet.model, "--metrics", f"{fleet.frontend_url}/metrics",
                  "-o", "json", *map(str, range(64)))
    ahead = (json.loads(shown.stdout).get("queued") or {}).get("frontend_pending") if shown.exit_code == 0 else None
    return (ahead, shown.stderr) if ahead else None


def test_doctor_names_a_frontend_holding_requests_then_its_empty_queue(queueing: Fleet) -> None:
    done = threading.Event()

    def client(k: int) -> None:  # one of 48 clients, each sending as soon as its last answer came: the queue
        n = k  # never empties between rounds, however slow the machine makes the doctor that samples it
        while not done.is_set():
            prompt = random.Random(n).sample(range(1000), 900)  # a prompt of its own: all of it to prefill
            body = {"model": queueing.model, "max_tokens": 32,
                    "messages": [{"role": "user", "content": words(prompt)}]}
            httpx.post(f"{queueing.frontend_url}/v1/chat/completions", json=body, timeout=120)
            n += 48

    clients = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(48)]
    for thread in clients:
        thread.start()
    try:
        held = wait_until(lambda: (f := _queue(queueing))["severity"] == "WARNING" and f or None,
                          "doctor naming the frontend's queue", timeout=120, procs=queueing.procs, interval=0.2)
        queued = wait_until(lambda: _route(queueing).get("queued"), "kvctl saying the frontend would queue a route",
                            timeout=120, procs=queueing.procs, interval=0.2)
        placed = wait_until(lambda: _placed(queueing), "kvctl route --metrics counting requests ahead of it",
                            timeout=120, procs=queueing.procs, interval=0.2)
    finally:
        done.set()
        for thread in clients:
            thread.join(150)
    assert "in its router queue" in held["cause"] and "policy class 'default'" in held["cause"], held
    assert queued["policy"] == "wspt" and len(queued["over"]) == 2, queued  # both mockers, prefill in flight
    assert held["next_step"].startswith(f"kvctl busy get --server {queueing.frontend_url}")
    ahead, said = placed
    assert f"the frontend holds {ahead} request" in said and "of class default now (wspt" in said, said
    empty = wait_until(lambda: (f := _queue(queueing))["severity"] == "OK" and f or None,
                       "the queue drained", timeout=120, procs=queueing.procs)
    assert empty["cause"] == "no request waits in a Dynamo frontend's router queue"
    # A public-hash frontend under overload and eviction: the requests that ended are judged tracked by public
    # hashes, so doctor's keyed-hash warning cannot fire on a fleet that merely evicts.
    status = httpx.get(f"{queueing.routers[ROUTER].url}/v1/status", timeout=10).json()
    tracking = status["event_plane"]["peers"]["tracking"]
    assert tracking["checked"] >= 8 and tracking["matched"] > tracking["checked"] // 2, tracking
