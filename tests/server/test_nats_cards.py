"""The NATS plane with the fleet's model cards (`kvctl serve --nats URL --dynamo-discovery STORE`, issue 38): NATS
carries no cards, so a disaggregated fleet on it was one pool of model `default`, its decode workers called silent.
Against a real nats-server and a file discovery store holding 1.6.1's own cards, rewritten to a prefill and a decode
worker: each worker goes to the model its card names, with its role, and a route answers both pools."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from kvctl.core.events import Tier
from kvctl.core.events.discovery import encode_file_name
from kvctl.core.events.plane import ActiveLoad, PlaneNames, encode_active_load
from kvctl.nats.barrier import barrier
from kvctl.nats.connection import NatsConnection
from kvctl.server.plane.model_cards import CardBlockSizes
from kvctl.server.plane.nats_plane import NatsOptions
from kvctl.server.state import Fleet
from tests.nats_server import NatsServer
from tests.server import test_nats_plane
from tests.server.test_model_cards import captured
from tests.server.test_nats_plane import Router, connected, envelope, store, wrapped
from tests.support import eventually_async

PREFILL, DECODE = 0x51, 0x52
_namespaces = itertools.count()


server = test_nats_plane.server  # a nats-server of this module's own, as that module starts one


@pytest.fixture
def names() -> PlaneNames:
    """A namespace of the test's own; its prefill workers' subject (their KV events are published there)."""
    return PlaneNames(f"cards{next(_namespaces)}", "prefill")


def _card(namespace: str, component: str, instance_id: int, worker_type: str) -> tuple[str, bytes]:
    """One of the captured 1.6.1 cards, as the card of a worker of another role, component and namespace."""
    record: dict[str, Any] = json.loads(next(iter(captured().values())))
    record.update(namespace=namespace, component=component, instance_id=instance_id)
    card = record["card_json"]
    card["worker_type"] = worker_type
    card["runtime_config"]["kv_event_publishing_enabled"] = worker_type != "decode"
    return f"{namespace}/{component}/generate/{instance_id:x}", json.dumps(record).encode()


def _file(root: Path, key: str, value: bytes) -> None:
    path = root / "v1" / "mdc" / encode_file_name(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(value)


def _options(server: NatsServer, names: PlaneNames, store: Path) -> NatsOptions:
    """Every component of the namespace (prefill workers publish under `prefill`, decode ones under `backend`),
    the cards read from `store`, their block sizes taken."""
    return NatsOptions(connection=NatsConnection(server.url), namespace=names.namespace, router_id=1,
                       cards=f"file:{store}", block_sizes=CardBlockSizes(True))


def _held(fleet: Fleet, model: str) -> dict[tuple[int, int], int]:
    state = fleet.models.get(model)
    return {} if state is None else dict(state.router.index.stats()[Tier.device].workers)


async def test_a_disaggregated_fleet_on_nats_is_two_pools_of_its_cards_model(server: NatsServer, names: PlaneNames,
                                                                            tmp_path: Path) -> None:
    for key, value in (_card(names.namespace, "prefill", PREFILL, "prefill"),
                       _card(names.namespace, "backend", DECODE, "decode")):
        _file(tmp_path, key, value)
    plane = _options(server, names, tmp_path)
    async with Router(plane) as router, connected(server) as nc:
        await nc.publish(names.kv_events, envelope(store(PREFILL, 0, list(range(64))), 0))
        load = encode_active_load(ActiveLoad(DECODE, 0, 0, 0, 0))  # decode workers publish load, no KV events
        await nc.publish(PlaneNames(names.namespace, "backend").kv_metrics, wrapped("kv_metrics", load))
        await barrier(nc)
        fleet = router.fleet
        await eventually_async(lambda: _held(fleet, "tiny") == {(PREFILL, 0): 4} and (DECODE, 0) in fleet.workers,
                               "the prefill worker's blocks and the decode worker, in model tiny")
        assert {w: (info.model, info.role) for w, info in fleet.workers.items()} == {
            (PREFILL, 0): ("tiny", "prefill"), (DECODE, 0): ("tiny", "decode")}
        assert dict(fleet.disaggregated) == {"tiny": {"prefill": 1, "decode": 1}}
        decision = fleet.route("tiny", now=0.0, token_ids=list(range(64)))
        assert (decision.role, decision.worker, decision.overlap_blocks) == ("prefill", (PREFILL, 0), 4)
        assert decision.decode is not None and decision.decode.worker == (DECODE, 0)
        status = router.plane.status()["model_cards"]
        assert (status["cards"], status["listings"] > 0, status["last_error"]) == (2, True, None)
        assert status["models"]["tiny"]["roles"] == {"prefill": 1, "decode": 1}


async def test_a_card_read_after_its_workers_events_moves_them_to_its_model(server: NatsServer, names: PlaneNames,
                                                                           tmp_path: Path) -> None:
    (tmp_path / "v1" / "mdc").mkdir(parents=True)
    plane = _options(server, names, tmp_path)
    async with Router(plane) as router, connected(server) as nc:
        await nc.publish(names.kv_events, envelope(store(PREFILL, 0, list(range(32))), 0))
        await barrier(nc)
        fleet = router.fleet
        await eventually_async(lambda: _held(fleet, "default") == {(PREFILL, 0): 2}, "the events, in default")
        _file(tmp_path, *_card(names.namespace, "prefill", PREFILL, "prefill"))
        await eventually_async(lambda: _held(fleet, "tiny") == {(PREFILL, 0): 2}, "the worker moved by its card")
        assert _held(fleet, "default") == {} and fleet.workers[(PREFILL, 0)].model == "tiny"
        await nc.publish(names.kv_events, envelope(store(PREFILL, 1, list(range(48)), None), 1))
        await barrier(nc)
        await eventually_async(lambda: _held(fleet, "tiny") == {(PREFILL, 0): 3}, "its next events in tiny")

