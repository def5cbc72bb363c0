"""`kvctl doctor` on a router following Dynamo's ZMQ event plane (`--dynamo-discovery`): a store with no record
of the namespace (a broker-mode fleet files none), and records whose advertised endpoints this router cannot
reach, a loopback one (a worker without DYN_EVENT_PLANE_HOST) named as such. Real routers, real file stores,
the captured records rewritten to the addresses under test."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from kvctl.core.events.discovery import ChannelKey, encode_file_name
from tests.doctor.rig import doctor, findings
from tests.server.test_serve_process import serving
from tests.server.test_zmq_plane import record_for
from tests.support import eventually


def record_file(root: Path, topic: str, publisher_id: int, address: str) -> None:
    key = ChannelKey("dynamo", "backend", "generate", topic, publisher_id).key
    path = root / "v1" / "event_channels" / encode_file_name(key.removeprefix("v1/event_channels/"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(record_for(topic, publisher_id, address))  # a captured record, at `address`


def _event_plane_until(url: str, wanted: str, *args: str) -> tuple[int, dict[str, Any]]:
    """Doctor until its event_plane finding's cause holds `wanted`; the exit code and that finding."""
    code, report = eventually(lambda: doctor(url, *args), f"doctor's event_plane finding to say {wanted!r}",
                              until=lambda answer: any(wanted in f["cause"]
                                                       for f in findings(answer[1], "event_plane")),
                              timeout=15, interval=0.2)
    return code, next(f for f in findings(report, "event_plane") if wanted in f["cause"])


def test_a_store_without_records_of_the_namespace_points_to_broker_mode_and_nats(tmp_path: Path) -> None:
    store = tmp_path / "discovery"
    store.mkdir()
    with serving(tmp_path / "router", "--no-restore", "--dynamo-discovery", f"file:{store}") as (_, client):
        code, finding = _event_plane_until(str(client.base_url).rstrip("/"), "no event-channel record")
    assert code == 2 and finding["severity"] == "CRITICAL"
    assert f"no event-channel record of namespace 'dynamo' in file:{store}" in finding["cause"]
    assert "DYN_ZMQ_BROKER_URL" in finding["next_step"] and "--event-plane nats" in finding["next_step"]
    assert f"kvctl events tail --dynamo-discovery file:{store} --namespace dynamo" in finding["next_step"]


def test_publishers_never_reached_are_named_a_loopback_one_as_not_routable(tmp_path: Path) -> None:
    store = tmp_path / "discovery"
    with socket.socket() as held:  # bound, never listening: refused, and no other test's server can take it
        held.bind(("127.0.0.1", 0))
        loopback = f"tcp://127.0.0.1:{held.getsockname()[1]}"  # only its own host could reach it anyway
        record_file(store, "kv-events", 0x11, loopback)
        record_file(store, "kv_metrics", 0x12, "tcp://192.0.2.1:5557")  # TEST-NET-1: routable, never answers
        with serving(tmp_path / "router", "--no-restore", "--dynamo-discovery", f"file:{store}") as (_, client):
            code, finding = _event_plane_until(str(client.base_url).rstrip("/"), "never reached",
                                               "--unreachable-after", "1")
    assert code == 2 and finding["severity"] == "CRITICAL"  # KV events among them: those blocks never arrive
    assert finding["cause"].startswith("2 publishers in discovery never reached for over 1 s (1 of them KV ")
    assert f"1 advertise an address only their own host can reach ({loopback})" in finding["cause"]
    assert "DYN_EVENT_PLANE_HOST" in finding["next_step"]
    assert {p["address"] for p in finding["evidence"]["publishers"]} == {loopback, "tcp://192.0.2.1:5557"}
