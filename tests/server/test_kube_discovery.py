"""Kubernetes discovery (`--dynamo-discovery kubernetes[:NAMESPACE]`) against recorded documents.

There is no Kubernetes API server here: these tests serve the DynamoWorkerMetadata documents two Dynamo 1.6.1
mockers applied (fixtures/dynamo-1.6.1-fleet/kubernetes, README there) from a stand-in on loopback
(tests/kube_api.py), through a kubeconfig naming it. The ZMQ plane's own tests of test_zmq_plane.py that do not
depend on the store's kind run here too, on this store (the `bench` fixture below).
"""

from __future__ import annotations

import base64
import json
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvctl.core.events.discovery import CHANNELS_BUCKET, encode_file_name, namespace_prefix, parse_event_channel
from kvctl.core.events.model_card import CARDS_BUCKET, cards_prefix, parse_model_card
from kvctl.errors import DiscoveryError
from kvctl.server.plane.dynamo_discovery import FileDiscovery, open_discovery
from kvctl.server.plane.kube_discovery import KubernetesDiscovery
from tests.commands.test_events_tail_record_replay import kvctl
from tests.fixtures_path import FIXTURES
from tests.kube_api import RECORDED, KubeApi, recorded_list, status
from tests.server.test_serve_process import refused, serving
from tests.server.test_zmq_plane import (  # noqa: F401  (collected here, on the `bench` below)
    STORE,
    Bench,
    test_a_publisher_is_dropped_with_its_record_and_a_worker_with_its_last_one,
    test_a_record_rewritten_in_place_moves_the_socket,
    test_every_captured_message_reaches_the_ingest_and_the_index,
    test_ready_with_an_empty_store_then_follows_what_registers,
)
from tests.support import eventually

LEGACY = FIXTURES / "dynamo-kube-legacy" / "v1_2_dwm.json"


class KubeBench(Bench):
    """The ZMQ plane's bench, its records in DynamoWorkerMetadata documents of a stand-in API server."""

    def __init__(self, root: Path, api: KubeApi) -> None:
        super().__init__(root)
        self.url = f"kubernetes:{api.namespace}"
        self.put = api.put  # type: ignore[method-assign]


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KubeApi]:
    server = KubeApi()
    monkeypatch.setenv("KUBECONFIG", str(server.kubeconfig(tmp_path / "kubeconfig")))
    yield server
    server.stop()


@pytest.fixture
async def bench(api: KubeApi, tmp_path: Path) -> AsyncIterator[Bench]:
    b = KubeBench(tmp_path / "unused", api)
    yield b
    await b.close()


async def listed(store: KubernetesDiscovery | FileDiscovery, namespace: str = "dynamo") -> dict[str, bytes]:
    try:
        return await store.list(namespace_prefix(namespace))
    finally:
        await store.close()


async def test_the_recorded_documents_yield_what_file_discovery_holds_for_the_same_channels(
        api: KubeApi, tmp_path: Path) -> None:
    for item in recorded_list()["items"]:
        api.set(item)
    found = await listed(open_discovery("kubernetes"))  # the kubeconfig context's namespace

    recorded = {f"{CHANNELS_BUCKET}/{k}": v for item in recorded_list()["items"]
                for k, v in item["spec"]["data"]["event_channels"].items()}
    assert len(found) == 8 and found.keys() == recorded.keys()  # 2 workers x 4 topics, keyed as etcd keys them
    assert all(parse_event_channel(value).key.key == key for key, value in found.items())
    bucket = tmp_path / "file" / CHANNELS_BUCKET
    bucket.mkdir(parents=True)
    for key, value in found.items():  # the same channels in Dynamo's file store
        (bucket / encode_file_name(key.removeprefix(CHANNELS_BUCKET + "/"))).write_bytes(value)
    assert await listed(FileDiscovery(tmp_path / "file")) == found
    assert {k: json.loads(v) for k, v in found.items()} == recorded
    file_fleet = {json.loads(p.read_bytes())["topic"]: json.loads(p.read_bytes()) for p in STORE.iterdir()}
    for record in recorded.values():  # the records of 1.6.1's file fleet, plus the scope's names flat
        same = file_fleet[record["topic"]]
        assert {k: v for k, v in record.items() if k not in ("instance_id", "transport", "namespace", "component")} \
            == {k: v for k, v in same.items() if k not in ("instance_id", "transport")}
        assert record["transport"]["kind"] == same["transport"]["kind"] == "Zmq"
        assert (record["namespace"], record["component"]) == ("dynamo", "backend")
    assert api.requests[0][1]["authorization"] == "Bearer t0ken"
    assert api.requests[0][0].startswith("/apis/nvidia.com/v1alpha1/namespaces/dynamo-test/dynamoworkermetadatas?")
    assert await listed(open_discovery("kubernetes:elsewhere")) == {}  # a namespace named: that one's


async def test_a_record_goes_with_its_document(api: KubeApi) -> None:
    first, second = recorded_list()["items"]
    api.set(first)
    api.set(second)
    store = open_discovery("kubernetes:dynamo-test")
    try:
        assert len(await store.list(namespace_prefix("dynamo"))) == 8
        api.delete(second["metadata"]["name"])  # its pod deleted: garbage-collected with it
        assert set(await store.list(namespace_prefix("dynamo"))) == {
            f"{CHANNELS_BUCKET}/{k}" for k in first["spec"]["data"]["event_channels"]}
        assert await store.list(namespace_prefix("dynamo2")) == {}
    finally:
        await store.close()


async def test_the_model_cards_are_listed_as_file_and_etcd_discovery_key_them(api: KubeApi) -> None:
    items = recorded_list()["items"]
    for item in items:
        api.set(item)
    store = open_discovery("kubernetes:dynamo-test")
    try:
        cards = await store.list(cards_prefix("dynamo"))
    finally:
        await store.close()
    assert set(cards) == {f"{CARDS_BUCKET}/{k}" for item in items for k in item["spec"]["data"]["model_cards"]}
    parsed = [parse_model_card(value) for value in cards.values()]
    assert len(parsed) == 2 and {c.model for c in parsed} == {"tiny"}
    assert all(key.endswith(f"/{c.instance_id:x}") for key, c in zip(cards, parsed, strict=True))


async def test_documents_of_another_shape_are_counted_once_and_the_rest_listed(api: KubeApi) -> None:
    good = recorded_list()["items"][0]
    api.set(good)
    api.set(json.loads(LEGACY.read_text()))  # Dynamo 1.2's: keys `ns/component/topic/id`, Nats transport
    api.set({"apiVersion": "nvidia.com/v1alpha1", "kind": "DynamoWorkerMetadata", "metadata": {"name": "null-data"},
             "spec": {"data": None}})  # Dynamo itself logs and skips this
    store = KubernetesDiscovery("dynamo-test")
    try:
        for _ in range(2):
            assert len(await store.list(namespace_prefix("dynamo"))) == 4
        assert store.refusals.counts == {"bad_channel_key": 2, "bad_document": 1}  # once each, not once per listing
        api.set(json.loads(LEGACY.read_text()))  # changed: counted again
        await store.list(namespace_prefix("dynamo"))
        assert store.refusals.counts["bad_channel_key"] == 4
    finally:
        await store.close()


async def test_a_record_past_the_cap_is_skipped_and_counted_the_rest_listed(api: KubeApi) -> None:
    """A DynamoWorkerMetadata is anyone's to write: one record of 100 KB (a real one is ~500 bytes) is refused."""
    good, bloated = recorded_list()["items"]
    key = next(iter(bloated["spec"]["data"]["event_channels"]))
    bloated["spec"]["data"]["event_channels"][key]["padding"] = "x" * 100_000
    api.set(good)
    api.set(bloated)
    store = KubernetesDiscovery("dynamo-test")
    try:
        for _ in range(2):
            listed = await store.list(namespace_prefix("dynamo"))
            assert len(listed) == 7 and f"{CHANNELS_BUCKET}/{key}" not in listed
        assert store.refusals.counts == {"too_large": 1}  # once, not once a listing
    finally:
        await store.close()


@pytest.mark.parametrize(("refusal", "needles"), [
    (status(401, "Unauthorized", "Unauthorized"), ["401", "renew the token"]),
    (status(403, "Forbidden", 'dynamoworkermetadatas.nvidia.com is forbidden: User "x" cannot list'),
     ["403", "RBAC `list` on dynamoworkermetadatas.nvidia.com in namespace dynamo-test"]),
    (status(404, "NotFound", "the server could not find the requested resource"), ["404", "install Dynamo's CRDs"]),
    ((200, b"<html>a proxy</html>"), ["not a DynamoWorkerMetadataList"]),
])
async def test_refusals_name_the_fix(api: KubeApi, refusal: tuple[int, bytes], needles: list[str]) -> None:
    api.refusal = refusal
    with pytest.raises(DiscoveryError) as caught:
        await listed(open_discovery("kubernetes"))
    assert all(n in str(caught.value) for n in needles), caught.value


async def test_an_unreachable_api_server_and_no_configuration_are_named(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    gone = KubeApi()
    gone.stop()
    monkeypatch.setenv("KUBECONFIG", str(gone.kubeconfig(tmp_path / "kubeconfig")))
    with pytest.raises(DiscoveryError, match=f"cannot reach the Kubernetes API server {gone.url}"):
        await listed(open_discovery("kubernetes"))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(DiscoveryError, match="set KUBECONFIG"):
        open_discovery("kubernetes")
    (tmp_path / "exec").write_text("current-context: c\ncontexts: [{name: c, context: {cluster: k, user: u}}]\n"
                                   "clusters: [{name: k, cluster: {server: 'https://k'}}]\n"
                                   "users: [{name: u, user: {exec: {command: aws}}}]\n")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "exec"))
    with pytest.raises(DiscoveryError, match="exec plugin"):
        open_discovery("kubernetes")


def test_serve_follows_the_recorded_fleet_and_reports_it(api: KubeApi, tmp_path: Path) -> None:
    for item in recorded_list()["items"]:
        api.set(item)
    with serving(tmp_path / "state", "--dynamo-discovery", "kubernetes:dynamo-test") as (_, client):
        def plane() -> dict[str, Any]:
            return client.get("/v1/status").json()["event_plane"]

        status_ = eventually(plane, "the plane ready with 8 connections",
                             until=lambda p: p["ready"] and len(p["connections"]) == 8, timeout=20, interval=0.1)
        assert status_["transport"] == "zmq" and status_["url"] == "kubernetes:dynamo-test"
        assert status_["discovery"]["stray"] == {} and status_["discovery"]["record_errors"] == {}
        assert {c["address"] for c in status_["connections"]} == {
            r["transport"]["config"]["endpoint"] for item in recorded_list()["items"]
            for r in item["spec"]["data"]["event_channels"].values()}


def test_serve_refuses_to_share_replica_sync_through_kubernetes(api: KubeApi, tmp_path: Path) -> None:
    code, _, err = refused("--dynamo-discovery", "kubernetes", "--replica-sync", "--state-dir", str(tmp_path))
    assert code == 2 and "add --shadow" in err and len(err.strip().splitlines()) == 1, err
    code, _, err = refused("--dynamo-discovery", "kubernetes:Bad_Name", "--state-dir", str(tmp_path))
    assert code == 2 and "Kubernetes namespace name" in err, err


def test_the_stand_in_serves_recorded_bytes() -> None:
    """The list is the two applied documents, each as Dynamo sent it plus the metadata a server adds."""
    items = {i["metadata"]["name"]: i for i in recorded_list()["items"]}
    for name, item in items.items():
        applied = json.loads((RECORDED / f"{name}.apply.json").read_bytes())
        added = {"namespace", "uid", "resourceVersion", "creationTimestamp", "generation"}
        assert {k: v for k, v in item["metadata"].items() if k not in added} == applied["metadata"]
        assert item["spec"] == applied["spec"]


def test_events_tail_follows_the_kubernetes_store_or_names_what_is_missing(api: KubeApi, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    for item in recorded_list()["items"]:
        api.set(item)
    tail = kvctl("events", "tail", "--dynamo-discovery", "kubernetes:dynamo-test", "--duration", "1")
    _, err = tail.communicate(timeout=30)
    assert tail.returncode == 4 and err.startswith(  # 4: the recorded publishers are not there to publish
        "listening on namespace.dynamo.component.*.endpoint.*.kv-events through "
        "kubernetes:dynamo-test (2 publishers)"), err
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    tail = kvctl("events", "tail", "--dynamo-discovery", "kubernetes", "--duration", "1")
    _, err = tail.communicate(timeout=30)
    assert tail.returncode == 2 and "set KUBECONFIG" in err and len(err.strip().splitlines()) == 1, err


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    """A cluster CA, the API server's certificate for 127.0.0.1 and a client's, both signed by it (openssl)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl binary to make certificates with")
    d = {name: tmp_path / name for name in ("ca.key", "ca.crt", "server.key", "server.crt", "client.key",
                                            "client.crt", "ext")}
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d["ca.key"]), "-out", str(d["ca.crt"]),
             "-days", "2", "-subj", "/CN=stand-in-ca")
    d["ext"].write_text("subjectAltName=IP:127.0.0.1\n")
    for who, subject in (("server", "/CN=127.0.0.1"), ("client", "/CN=reader/O=kvctl")):
        csr = tmp_path / f"{who}.csr"
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d[f"{who}.key"]), "-out", str(csr),
                 "-subj", subject)
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(d["ca.crt"]), "-CAkey", str(d["ca.key"]),
                 "-CAcreateserial", "-out", str(d[f"{who}.crt"]), "-days", "2", "-extfile", str(d["ext"]))
    return d


async def test_tls_with_the_clusters_ca_and_a_client_certificate(pki: dict[str, Path], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=pki["ca.crt"])
    tls.load_cert_chain(pki["server.crt"], pki["server.key"])
    tls.verify_mode = ssl.CERT_REQUIRED  # the API server asks for a client certificate
    api = KubeApi(tls=tls)
    try:
        api.set(recorded_list()["items"][0])
        data = {"certificate-authority-data": base64.b64encode(pki["ca.crt"].read_bytes()).decode()}
        user = {"client-certificate": str(pki["client.crt"]), "client-key-data":
                base64.b64encode(pki["client.key"].read_bytes()).decode()}
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path / "tls", cluster=data, user=user)))
        assert len(await listed(open_discovery("kubernetes"))) == 4
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path / "no-ca", user=user)))
        with pytest.raises(DiscoveryError, match="cannot reach the Kubernetes API server.*CERTIFICATE_VERIFY_FAILED"):
            await listed(open_discovery("kubernetes"))
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path / "no-cert", cluster=data)))
        with pytest.raises(DiscoveryError, match="cannot reach the Kubernetes API server"):
            await listed(open_discovery("kubernetes"))
        assert api.requests and all("authorization" not in headers for _, headers in api.requests)
    finally:
        api.stop()
