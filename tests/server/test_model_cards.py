"""The model cards a `--dynamo-discovery` plane reads (issue 38): each worker's role, event publishing and KV
capacity onto the fleet; what the cards name in status; and doctor setting the cards' block size against the
router's. Real records: the captured 1.6.1 store's cards, rewritten field by field where a test needs another."""

from __future__ import annotations

import json
from array import array
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvctl.core.doctor import Limits, Severity, check_silent
from kvctl.core.events import RouterEvent, Stored, Tier
from kvctl.core.events.discovery import decode_file_name, encode_file_name
from kvctl.core.hashing import packed_block_hashes
from kvctl.core.names import WorkerKey
from kvctl.server.http.api import create_app
from kvctl.server.persistence import replay
from kvctl.server.persistence.state_log import StateLog
from kvctl.server.plane import model_cards
from kvctl.server.plane.model_cards import CardBook
from kvctl.server.state import Fleet
from kvctl.server.worker_info import WorkerInfo
from tests.doctor.rig import doctor, findings
from tests.fixtures_path import FIXTURES
from tests.server.test_serve_process import serving
from tests.support import eventually

CARDS = FIXTURES / "dynamo-1.6.1-fleet" / "zmq-plane" / "file-discovery" / "v1" / "mdc"


def captured() -> dict[str, bytes]:
    return {"v1/mdc/" + decode_file_name(p.name): p.read_bytes() for p in sorted(CARDS.iterdir())}


def rewritten(value: bytes, *, component: str | None = None, instance_id: int | None = None,
              **card: Any) -> dict[str, Any]:
    record = json.loads(value)
    record["card_json"].update(card)
    if component is not None:
        record["component"] = component
    if instance_id is not None:
        record["instance_id"] = instance_id
    return record


def test_the_cards_of_the_scope_are_read_and_the_rest_counted() -> None:
    records = captured()
    prefill = rewritten(next(iter(records.values())), component="prefill", instance_id=1)
    records["v1/mdc/dynamo/prefill/generate/1"] = json.dumps(prefill).encode()
    records["v1/mdc/dynamo/backend/generate/2"] = b'{"type": "Model"}'
    book = CardBook("backend", None)
    book.read(records)
    assert book.status() == {"cards": 2, "errors": {"missing_field": 1}, "over_cap": 0, "models": {"tiny": {
        "block_sizes": [16], "roles": {"aggregated": 2}, "workers": 2, "silent_by_design": 0}}}
    everything = CardBook(None, None)
    everything.read(records)
    assert everything.status()["cards"] == 3


def test_a_card_gives_its_worker_a_role_and_a_capacity_unless_one_was_set() -> None:
    records = captured()
    (key, value), (other_key, other) = records.items()
    records[key] = json.dumps(rewritten(value, worker_type="decode", runtime_config={
        **json.loads(value)["card_json"]["runtime_config"], "kv_event_publishing_enabled": False})).encode()
    decode, agg = (json.loads(records[k])["instance_id"] for k in (key, other_key))
    fleet = Fleet()
    fleet.register(WorkerInfo(decode, 0, "default"))
    fleet.register(WorkerInfo(agg, 0, "default", total_blocks=40))
    book = CardBook(None, None)
    book.read(records)
    book.apply(fleet, 0.0, lambda _: False)
    one, two = fleet.workers[(decode, 0)], fleet.workers[(agg, 0)]
    assert (one.role, one.publishes_kv_events, one.total_blocks, one.max_num_batched_tokens) == ("decode", False, 96,
                                                                                                8192)
    assert (two.role, two.publishes_kv_events, two.total_blocks) == ("aggregated", True, 40)


def test_a_model_whose_cards_say_eagle_routes_prompts_as_its_eagle_workers_store_them() -> None:
    """SGLang EAGLE workers store blocks of B + 1 tokens (its bigram pages); Dynamo's router hashes a prompt so for
    a model whose cards say enable_eagle, and so does kvctl: the overlap is there, where plain hashes find none."""
    records = captured()
    for key, value in records.items():
        runtime = json.loads(value)["card_json"]["runtime_config"]
        records[key] = json.dumps(rewritten(value, runtime_config={**runtime, "enable_eagle": True})).encode()
    worker = json.loads(next(iter(records.values())))["instance_id"]
    fleet = Fleet()
    fleet.register(WorkerInfo(worker, 0, "tiny"))
    book = CardBook(None, None)
    book.read(records)
    tokens = list(range(1, 16 * 4 + 2))  # 4 blocks and the token after: what an EAGLE store of 4 pages holds
    eagle_local = packed_block_hashes(tokens, 16, eagle=True)
    fleet.apply("tiny", [RouterEvent(worker, Stored(None, [11, 12, 13, 14], eagle_local))], 0.0)

    def overlap() -> int:
        return fleet.route("tiny", now=0.0, token_ids=tokens).overlap_blocks

    assert overlap() == 0  # hashed plainly, the prompt's blocks are not the ones the worker stored
    book.apply(fleet, 0.0, lambda _: True)
    assert fleet.model("tiny").router.eagle and overlap() == 4
    records = {k: json.dumps(rewritten(v, runtime_config={**json.loads(v)["card_json"]["runtime_config"],
                                                            "enable_eagle": False})).encode()
               for k, v in records.items()}
    book.read(records)
    book.apply(fleet, 0.0, lambda _: True)
    assert not fleet.model("tiny").router.eagle and overlap() == 0


async def test_a_route_on_a_disaggregated_fleet_picks_from_each_pool_apart() -> None:
    """Once the cards make the model disaggregated, a route answers Dynamo's two picks: the prefill pool's, with
    no decode term, and the decode pool's, with no overlap credit and no prefill term (issue 38)."""
    records = captured()
    (key, value), (other_key, other) = records.items()
    records[key] = json.dumps(rewritten(value, worker_type="decode")).encode()
    records[other_key] = json.dumps(rewritten(other, worker_type="prefill")).encode()
    decode, prefill = (json.loads(records[k])["instance_id"] for k in (key, other_key))
    fleet = Fleet()
    for worker in (decode, prefill):
        fleet.register(WorkerInfo(worker, 0, "default"))
    body = {"model": "tiny", "token_ids": list(range(64)), "explain": True}
    app = create_app(fleet)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
        before = (await client.post("/v1/route", json={**body, "model": "default"})).json()
        book = CardBook(None, None)
        book.read(records)
        book.apply(fleet, 0.0, lambda _: False)
        after = (await client.post("/v1/route", json=body)).json()
        reserved = await client.post("/v1/route", json={**body, "request_id": "r", "reserve": True})
    assert "decode" not in before and "role" not in before and len(before["candidates"]) == 2
    assert (after["role"], after["worker_id"], [c["logit"] for c in after["candidates"]]) == ("prefill", prefill, [4.0])
    split = after["decode"]
    assert (split["role"], split["worker_id"], [c["logit"] for c in split["candidates"]]) == ("decode", decode, [4.0])
    assert reserved.status_code == 409 and "disaggregated (1 prefill worker and 1 decode worker)" in \
        reserved.json()["error"]
    assert dict(fleet.disaggregated) == {"tiny": {"prefill": 1, "decode": 1}}


def test_doctor_keeps_decode_workers_that_publish_nothing_out_of_silent() -> None:
    rows = [{"worker_id": 1, "dp_rank": 0, "model": "default", "last_event_age_s": None, "routes": 0,
             "publishes_kv_events": False},
            {"worker_id": 2, "dp_rank": 0, "model": "default", "last_event_age_s": 1.0, "routes": 3,
             "publishes_kv_events": True}]
    by_design, rest = check_silent({"models": {}, "streams": []}, rows, Limits())
    assert by_design.severity is Severity.OK and by_design.evidence["workers"] == ["1:0"]
    assert by_design.cause.startswith("1 of 2 workers publish no KV events by their model cards")
    assert rest.severity is Severity.OK and rest.cause.startswith("the other 1 worker sent events")


def _store(root: Path, records: dict[str, bytes]) -> Path:
    for key, value in records.items():
        path = root / "v1" / "mdc" / encode_file_name(key.removeprefix("v1/mdc/"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(value)
    return root


def _block_size_finding(client: httpx.Client) -> dict[str, Any]:
    """Doctor's block_size finding once the plane has read the cards, with the cards' workers registered (a
    router without workers gets no further than saying so)."""
    for value in captured().values():
        client.post("/v1/workers", json={"worker_id": json.loads(value)["instance_id"]}).raise_for_status()
    url = str(client.base_url).rstrip("/")
    report = eventually(lambda: doctor(url)[1], "doctor to read the cards",
                        until=lambda r: any("card" in f["cause"] for f in findings(r, "block_size")))
    [finding] = findings(report, "block_size")
    return finding


def test_a_block_size_given_against_the_cards_is_critical_and_none_given_takes_theirs(tmp_path: Path) -> None:
    """An SGLang-style fleet at page size 32 followed at kvctl's default 16: the index filled, every overlap was 0,
    and doctor said OK (issue 38). Given no --block-size, the router now takes the cards'; given one that
    differs, doctor names the block size to pass."""
    store = _store(tmp_path / "discovery", {k: json.dumps(rewritten(v, kv_cache_block_size=32)).encode()
                                            for k, v in captured().items()})
    plane = ["--no-restore", "--dynamo-discovery", f"file:{store}"]
    with serving(tmp_path / "router", *plane, "--block-size", "16") as (_, client):
        finding = _block_size_finding(client)
    assert finding["severity"] == "CRITICAL" and "model 'tiny' 32-token blocks" in finding["cause"]
    assert finding["next_step"] == "restart kvctl serve with --block-size 32"
    assert finding["evidence"]["router_block_sizes"] == {"tiny": 16}
    with serving(tmp_path / "router", *plane) as (_, client):
        finding = _block_size_finding(client)
        block_size = client.get("/v1/tree/stats").json()["models"]["tiny"]["block_size"]
    assert block_size == 32 and finding["severity"] == "OK"
    assert finding["cause"] == "block sizes match the fleet's model cards: model 'tiny' at 32"


def _chain(fleet: Fleet, model: str, worker: WorkerKey, first: int, n: int) -> None:
    """`n` blocks stored in a chain by `worker`, through the path an event plane's writer takes."""
    fleet.apply_engine_batch(model, worker, [Stored(None, list(range(first, first + n)),
                                                    array("Q", range(first, first + n)))], 0.0)


def _held(fleet: Fleet, model: str) -> dict[WorkerKey, int]:
    return dict(fleet.model(model).router.index.stats()[Tier.device].workers)


def test_a_worker_heard_of_before_its_card_moves_to_the_cards_model_with_its_blocks(tmp_path: Path) -> None:
    """A plane put every worker into one model (`default`) where Dynamo names it by its card (`tiny`), so every
    command without -m read a model nobody routes (issue 38). A worker heard of before its card is read moves
    whole: its blocks, not a cleared index to recover; a request booked on it in the old model ends; the state
    log says so, so a restore with no plane at all finds it where it went; its next events follow it."""
    (card,) = list(captured().values())[:1]
    worker = (json.loads(card)["instance_id"], 0)
    fleet = Fleet()
    state_log = StateLog(tmp_path, fleet, restored_from=None)
    _chain(fleet, "default", worker, 1, 4)
    _chain(fleet, "default", (7, 0), 100, 2)  # no card: stays
    fleet.model("default").router.sequences.add("r", worker, [1, 2], 32, 0.0)
    book = CardBook(None, None)
    book.read({"v1/mdc/x": card})
    book.apply(fleet, 0.0, lambda _: False)
    assert fleet.workers[worker].model == "tiny" and fleet.workers[(7, 0)].model == "default"
    assert _held(fleet, "tiny") == {worker: 4} and _held(fleet, "default") == {(7, 0): 2}
    assert fleet.model("default").router.sequences.requests(worker) == []
    _chain(fleet, "default", worker, 5, 1)  # the plane's writer still names its own model: the card's wins
    assert _held(fleet, "tiny") == {worker: 5}
    state_log.flush(fsync=True).result()
    state_log.close()
    restored = Fleet()
    replay.restore(restored, tmp_path, 0.0)
    assert restored.workers[worker].model == "tiny"
    assert _held(restored, "tiny") == {worker: 5} and _held(restored, "default") == {(7, 0): 2}


def test_cards_naming_more_models_than_the_cap_are_counted_not_indexed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each model a card names is an index and a router: a discovery store naming thousands must not make them."""
    monkeypatch.setattr(model_cards, "MAX_MODELS", 1)
    first, second = list(captured().values())[:2]
    records = {"v1/mdc/a": first, "v1/mdc/b": json.dumps(rewritten(second, display_name="other")).encode()}
    book = CardBook(None, None)
    book.read(records)
    fleet = Fleet()
    book.apply(fleet, 0.0, lambda _: True)
    assert book.status()["over_cap"] == 1 and set(fleet.models) == {"default", "tiny"}
