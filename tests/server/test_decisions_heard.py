"""`POST /v1/decisions`: a recording's routing decisions heard as replica sync hears them from a plane. Each routed
request is audited against the index as it is, then booked, so that the next decision is priced under the loads
the earlier ones left; what is malformed costs itself; the body is bounded."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from kvctl.core.events.plane import ActiveSequenceEvent, AddRequest, sequence_event_obj
from kvctl.server.http.api import create_app
from kvctl.server.http.audit_routes import MAX_DECISIONS
from kvctl.server.state import Fleet
from tests.server.test_audit import FRONTEND, SEQ, Clock, fleet_with_cache
from tests.support.served import served

TOKEN = "s3cret"


def routed(request_id: str, worker: int, router: int = FRONTEND) -> dict:
    return sequence_event_obj(ActiveSequenceEvent(request_id, worker, 0, AddRequest(SEQ, True, None, None), router))


def freed(request_id: str, worker: int) -> dict:
    return sequence_event_obj(ActiveSequenceEvent(request_id, worker, 0, "Free", FRONTEND))


@pytest.fixture
async def router() -> AsyncIterator[tuple[Fleet, httpx.AsyncClient]]:
    fleet = fleet_with_cache()
    async with served(create_app(fleet, clock=Clock(), admin_token=TOKEN), "asgi") as client:
        client.headers["authorization"] = f"Bearer {TOKEN}"
        yield fleet, client


async def test_each_routed_request_is_audited_then_booked_and_freed(router: tuple[Fleet, httpx.AsyncClient]) -> None:
    fleet, client = router
    answer = await client.post("/v1/decisions", json=[routed("good", 1), routed("poor", 2)])
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"heard": 2, "audited": 2, "booked": {"peer_booked": 2}, "rejected": {}}
    audit = (await client.get("/v1/audit", params={"window": 60, "recent": 5})).json()
    assert [(d["request_id"], d["outcome"], d["router"]) for d in audit["recent"]] == [
        ("good", "optimal", str(FRONTEND)), ("poor", "suboptimal", str(FRONTEND))]
    sequences = fleet.model("default").router.sequences
    assert sequences.peer_requests == 2  # the next decision is priced under both
    third = await client.post("/v1/decisions", json=[routed("third", 1)])
    assert third.json()["audited"] == 1
    rows = {r["worker_id"]: r for r in (await client.get("/v1/audit/third")).json()["candidates"]}
    good = (await client.get("/v1/audit/good")).json()["candidates"]
    assert rows[1]["logit"] > next(r["logit"] for r in good if r["worker_id"] == 1)  # "good" weighs on worker 1
    done = await client.post("/v1/decisions", json=[freed("good", 1), freed("never-booked", 1)])
    assert done.json() == {"heard": 2, "audited": 0, "booked": {"peer_freed": 1, "peer_unmatched": 1},
                           "rejected": {}}
    assert sequences.peer_requests == 2


async def test_a_malformed_decision_costs_itself_and_a_worker_not_heard_of_waits(
        router: tuple[Fleet, httpx.AsyncClient]) -> None:
    fleet, client = router
    answer = await client.post("/v1/decisions", json=[routed("a", 1), {"request_id": 5}, routed("b", 42)])
    assert answer.json() == {"heard": 3, "audited": 2, "rejected": {"bad_type": 1},
                             "booked": {"peer_booked": 1, "peer_refused": 1}}
    assert fleet.audit.waiting == 1  # judged once worker 42 registers, or its grace is over
    lines = "\n".join(map(str, [1, 2]))
    bad_lines = await client.post("/v1/decisions", content=lines, headers={"content-type": "application/x-ndjson"})
    assert bad_lines.json()["rejected"] == {"bad_type": 2}


@pytest.mark.parametrize(("body", "status", "says"), [
    (b"{not json", 400, "body is not JSON"),
    (b"[" + b",".join([b"{}"] * (MAX_DECISIONS + 1)) + b"]", 422, "at most 10,000 decisions in one body"),
])
async def test_a_bad_body_is_refused_saying_why(router: tuple[Fleet, httpx.AsyncClient], body: bytes, status: int,
                                                says: str) -> None:
    _, client = router
    answer = await client.post("/v1/decisions", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == status and says in answer.text, answer.text


async def test_decisions_need_the_admin_token_and_a_model_the_router_serves(
        router: tuple[Fleet, httpx.AsyncClient]) -> None:
    fleet, client = router
    anonymous = await client.post("/v1/decisions", json=[routed("a", 1)], headers={"authorization": ""})
    assert anonymous.status_code == 401
    unknown = await client.post("/v1/decisions", params={"model": "nope"}, json=[routed("a", 1)])
    assert unknown.status_code == 404 and "default" in unknown.text
    assert fleet.audit.ledger.seen == 0
