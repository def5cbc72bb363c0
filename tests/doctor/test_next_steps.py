"""doctor's next steps name what the router knows (a silent worker's endpoint, its event plane), never a
placeholder for the reader to fill in."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvctl.core.doctor import Limits, check_silent, check_streams
from tests.commands.live_router import loaded_router

Answers = tuple[dict[str, Any], list[dict[str, Any]]]


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Answers]:
    """/v1/status and /v1/workers of a router fed Dynamo's fixture dump by POST, an hour later (as each worker's
    last event age reads then) with a request in flight on each: every worker silent while serving."""
    with loaded_router(Path(tmp_path_factory.mktemp("router"))) as client:
        workers = client.get("/v1/workers").json()["workers"]
        yield client.get("/v1/status").json(), [{**w, "last_event_age_s": 3600.0, "active_requests": 1}
                                                for w in workers]


def silent_step(status: dict[str, Any], workers: list[dict[str, Any]]) -> str:
    [finding] = check_silent(status, workers, Limits())
    assert finding.check == "silent" and finding.evidence["count"] == len(workers)
    return finding.next_step


def test_a_registered_endpoint_is_the_one_to_tail(answers: Answers) -> None:
    status, workers = copy.deepcopy(answers)
    workers[0]["endpoint"] = "tcp://10.0.0.7:5557"
    step = silent_step(status, workers)
    assert step.startswith(f"kvctl events tail --zmq tcp://10.0.0.7:5557 --worker-id {workers[0]['worker_id']}  ")
    assert "<" not in step


def test_the_address_a_publisher_advertises_on_the_zmq_plane(answers: Answers) -> None:
    status, workers = copy.deepcopy(answers)
    workers[0]["event_plane"] = {"publisher_id": 5, "last_event_id": 3, "address": "tcp://10.0.0.8:20080"}
    assert silent_step(status, workers).startswith("kvctl events tail --zmq tcp://10.0.0.8:20080 ")


def test_a_nats_event_plane_with_its_scope(answers: Answers) -> None:
    status, workers = copy.deepcopy(answers)
    status["event_plane"] = {"url": "nats://nats:4222", "namespace": "prod", "component": "backend"}
    assert silent_step(status, workers).startswith(
        "kvctl events tail --nats nats://nats:4222 --namespace prod --component backend  ")


def test_without_an_endpoint_it_says_none_is_registered(answers: Answers) -> None:
    status, workers = copy.deepcopy(answers)
    step = silent_step(status, workers)
    assert "no KV-event endpoint is registered for worker" in step and "<" not in step


def decode_step(status: dict[str, Any]) -> str:
    [finding] = [f for f in check_streams(status) if f.check == "decode"]
    return finding.next_step


def test_undecodable_events_are_tailed_where_they_come_from(answers: Answers) -> None:
    status, _ = copy.deepcopy(answers)
    stream = {"worker": {"worker_id": 5, "dp_rank": 0}, "endpoint": "tcp://10.0.0.9:5557",
              "decode_errors": {"bad_msgpack": 3}}
    assert decode_step({**status, "streams": [stream]}).startswith(
        "kvctl events tail --zmq tcp://10.0.0.9:5557 --worker-id 5  ")
    zmq_plane = {"transport": "zmq", "namespace": "prod", "discovery": {"url": "file:/var/dynamo"},
                 "decode_errors": {"bad_envelope": 1}}
    assert decode_step({**status, "streams": [], "event_plane": zmq_plane}).startswith(
        "kvctl events tail --dynamo-discovery file:/var/dynamo --namespace prod  ")
