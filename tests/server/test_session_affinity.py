"""Session affinity in the router (`--router-session-affinity-ttl-secs`): a frontend's captured bindings reach the
fleet through the plane's ingest, and a route naming the session goes to its pinned worker, `reason` pinned, over
a worker holding more of the prompt; a booked route pins a new session; without session affinity on, bindings
are counted and routes are the cost function's."""

from __future__ import annotations

import json

import httpx

from kvctl.core.events import RouterEvent, Stored
from kvctl.core.events.dynamo import decode_envelope
from kvctl.core.events.session_affinity import decode_session_binding
from kvctl.core.events.zmq_wire import decode_zmq_message
from kvctl.core.hashing import local_block_hashes, sequence_hashes
from kvctl.core.router.sessions import SessionBook
from kvctl.server.http.api import create_app
from kvctl.server.ingest.streams import ModelWriter
from kvctl.server.plane.ingest import PlaneIngest
from kvctl.server.state import Fleet
from kvctl.server.worker_info import WorkerInfo
from tests.fixtures_path import FIXTURES

CAPTURE = FIXTURES / "dynamo-1.6.1-fleet" / "zmq-plane" / "zmq_capture_session_affinity.jsonl"
PROMPT = list(range(64))


def _envelopes() -> list[bytes]:
    return [decode_zmq_message([bytes.fromhex(f) for f in json.loads(line)["frames_hex"]]).envelope
            for line in CAPTURE.read_text().splitlines()]


async def _fleet(sessions: SessionBook | None) -> tuple[Fleet, int, int]:
    """A fleet of the captured session's worker and another that holds the whole prompt; the bindings fed in."""
    pinned = decode_session_binding(decode_envelope(_envelopes()[0]).payload).worker[0]
    other = pinned + 1
    fleet = Fleet(sessions=sessions)
    for worker in (pinned, other):
        fleet.register(WorkerInfo(worker, 0, "default"))
    local = local_block_hashes(PROMPT, 16)
    fleet.model("default").router.index.apply(RouterEvent(other, Stored(None, sequence_hashes(local), local)))
    writer = ModelWriter(fleet, "default")
    ingest = PlaneIngest(fleet, writer, model="default", router_id=9, replica_sync=False, surface="zmq")
    for envelope in _envelopes():
        await ingest.receive("backend", "generate", "session_affinity_events", envelope)
    writer.task.cancel()
    assert ingest.counts["session_bindings"] == 6 and not ingest.errors
    return fleet, pinned, other


async def _route(fleet: Fleet, **body: object) -> dict:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(fleet)), base_url="http://r") as c:
        return (await c.post("/v1/route", json={"token_ids": PROMPT, "explain": True, **body})).json()


async def test_a_session_goes_to_its_pinned_worker_over_a_better_cached_one() -> None:
    fleet, pinned, other = await _fleet(SessionBook(30))
    assert (await _route(fleet))["worker_id"] == other  # the cost function: the whole prompt cached there
    answer = await _route(fleet, session_id="sess-A")
    assert (answer["worker_id"], answer["reason"]) == (pinned, "pinned")
    assert [c["worker_id"] for c in answer["candidates"]] == [pinned] and answer["candidates"][0]["logit"] == 8.0
    unknown = await _route(fleet, session_id="sess-new", request_id="r", reserve=True)
    assert unknown["worker_id"] == other and unknown["reason"] == "lowest_logit"
    assert (await _route(fleet, session_id="sess-new"))["reason"] == "pinned"  # the booked route pinned it


async def test_without_session_affinity_bindings_are_counted_and_routes_are_the_cost_functions() -> None:
    fleet, _, other = await _fleet(None)
    answer = await _route(fleet, session_id="sess-A")
    assert (answer["worker_id"], answer["reason"]) == (other, "lowest_logit")
