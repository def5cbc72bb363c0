"""A kvctl router that joins a Dynamo 1.6.1 fleet's engine streams mid-way, with no replay to recover what came
before: the mockers store new blocks under prefixes it never saw, it rejects those stores (unknown parent), and
`doctor` says its index is partial and for which workers."""

from __future__ import annotations

from typing import Any

import httpx

from tests.doctor.rig import doctor, findings
from tests.interop.fleet import BLOCK_SIZE, MODEL, Fleet, wait_until, words

PREFIX = words(range(30_000, 30_000 + 12 * BLOCK_SIZE))


def _complete(fleet: Fleet, suffix_from: int) -> None:
    prompt = f"{PREFIX} {words(range(suffix_from, suffix_from + 4 * BLOCK_SIZE))}"
    answer = httpx.post(f"{fleet.frontend_url}/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                                      "max_tokens": 4}, timeout=60)
    assert answer.status_code == 200, answer.text


def test_doctor_names_a_router_that_joined_mid_stream_as_partial(fleet: Fleet) -> None:
    _complete(fleet, 40_000)  # the prefix is cached on some mocker before the late router exists
    late = fleet.start_router("late", *(a for m in fleet.mockers
                                        for a in ("--worker", f"{m.worker_id}={m.zmq_endpoint}")))  # no replay
    try:
        fleet.await_router(late)
        wait_until(lambda: len(httpx.get(f"{late.url}/v1/status", timeout=5).json()["streams"])
                   == len(fleet.mockers), "the late router's streams", timeout=30, procs=[late.proc])
        for n in range(4):  # new suffixes under the cached prefix: stored under a parent the late router never saw
            _complete(fleet, 41_000 + n * 100)
        finding = wait_until(lambda: _partial(late.url), "doctor naming the late router's index partial",
                             timeout=20, procs=[late.proc])
    finally:
        late.proc.stop()
        del fleet.routers["late"]
    assert finding["severity"] == "WARNING"
    rejected = finding["evidence"]["rejected_for_unknown_parent"]
    assert rejected and {int(name.split(":")[0]) for name in rejected} <= set(fleet.worker_ids)
    assert fleet.kvctl_url is not None and _partial(fleet.kvctl_url) is None  # joined first, with replay: whole


def _partial(url: str) -> dict[str, Any] | None:
    found = findings(doctor(url)[1], "partial")
    return found[0] if found else None
