"""`kvctl serve --dynamo-discovery etcd:URL` on a Dynamo 1.6.1 fleet whose discovery is etcd (`--discovery-backend
etcd`, a real etcd 3.4) and whose event plane is ZMQ: the same checks as with file discovery (test_zmq_plane.py),
the publishers found in etcd. A fleet of its own: two mockers, the frontend, the indexer and this router."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.etcd_server import EtcdServer
from tests.interop.fleet import Fleet, start_fleet, wait_until
from tests.interop.test_zmq_plane import (
    ROUTER,
    SHARING,
    following,
    holds_dynamos_index_and_decodes_every_topic,
    replica_sync_both_ways_over_zmq,
    restarted_mocker_is_followed,
)


@pytest.fixture(scope="module")
def etcd_fleet(dynamo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    etcd = EtcdServer(tmp_path_factory.mktemp("interop-etcd"))
    try:
        started = start_fleet(tmp_path_factory.mktemp("interop-zmq-etcd-fleet"), dynamo, mockers=2, nats_url=None,
                              kvctl=False, etcd_url=etcd.url,
                              routers={ROUTER: ["--dynamo-discovery", f"etcd:{etcd.url}", "--namespace", "dynamo",
                                                *SHARING]})
        try:
            wait_until(lambda: following(started) or None, "kvctl following every mocker's kv-events channel",
                       timeout=30, procs=started.procs)
            yield started
        finally:
            started.stop()
    finally:
        etcd.stop()


def test_the_router_finds_the_publishers_in_etcd_and_holds_dynamos_index(etcd_fleet: Fleet) -> None:
    assert not etcd_fleet.discovery_dir.exists()  # nothing in files: every record is in etcd
    holds_dynamos_index_and_decodes_every_topic(etcd_fleet, seed=7)


def test_replica_sync_both_ways_with_the_records_in_etcd(etcd_fleet: Fleet) -> None:
    replica_sync_both_ways_over_zmq(etcd_fleet)


def test_a_restarted_mocker_is_followed_in_etcd(etcd_fleet: Fleet) -> None:
    """Its old identity's keys go with its lease (revoked on a clean stop), the new identity's are found."""
    restarted_mocker_is_followed(etcd_fleet)
