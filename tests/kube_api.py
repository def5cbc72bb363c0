"""A stand-in Kubernetes API server on a free loopback port: Kubernetes discovery has no API server here, so
its tests are served the DynamoWorkerMetadata documents recorded from Dynamo 1.6.1 workers
(fixtures/dynamo-1.6.1-fleet/kubernetes). It answers the one call kvctl makes, the namespaced list, from the
documents it holds (as a list in the recorded shape), with a Status for a refusal, and keeps each request's path
and headers. A record of the Bench's (`put`) goes into a copy of a recorded document, one per publisher, as
each Dynamo pod files its own; withdrawing it deletes that document, as the pod's garbage collection does.
"""

from __future__ import annotations

import copy
import json
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tests.fixtures_path import FIXTURES

RECORDED = FIXTURES / "dynamo-1.6.1-fleet" / "kubernetes"
COLLECTION = "/apis/nvidia.com/v1alpha1/namespaces/{ns}/dynamoworkermetadatas"


def recorded_list() -> dict[str, Any]:
    """The list response built from the two recorded workers' documents."""
    return json.loads((RECORDED / "dynamoworkermetadatas.list.json").read_text())


class KubeApi:
    def __init__(self, namespace: str = "dynamo-test", tls: ssl.SSLContext | None = None) -> None:
        self.namespace = namespace
        self.documents: dict[str, dict[str, Any]] = {}  # name -> document
        self.refusal: tuple[int, bytes] | None = None  # (status, body) answered instead of the list
        self.requests: list[tuple[str, dict[str, str]]] = []
        self._version = 100
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        if tls is not None:  # HTTPS, as a real API server: each connection wrapped as it is accepted
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def kubeconfig(self, path: Path, *, token: str = "t0ken", namespace: str | None = None,
                   cluster: dict[str, Any] | None = None, user: dict[str, Any] | None = None) -> Path:
        """A kubeconfig naming this server, a bearer token (or `user`), and the context's namespace (this
        server's); `cluster` adds to the cluster's entry."""
        path.write_text(json.dumps({  # JSON is YAML
            "apiVersion": "v1", "kind": "Config", "current-context": "here",
            "clusters": [{"name": "stand-in", "cluster": {"server": self.url, **(cluster or {})}}],
            "users": [{"name": "reader", "user": user if user is not None else {"token": token}}],
            "contexts": [{"name": "here", "context": {"cluster": "stand-in", "user": "reader",
                                                      "namespace": namespace or self.namespace}}],
        }))
        return path

    def set(self, document: dict[str, Any]) -> None:
        """File or replace a document (a new resourceVersion, as the server gives each write)."""
        with self._lock:
            self._version += 1
            document = copy.deepcopy(document)
            document["metadata"]["resourceVersion"] = str(self._version)
            self.documents[document["metadata"]["name"]] = document

    def delete(self, name: str) -> None:
        with self._lock:
            self.documents.pop(name, None)

    def put(self, key: str, value: bytes) -> Any:
        """A record in a document of its own, named after its publisher; what deletes that document."""
        base = recorded_list()["items"][0]
        rest = key.removeprefix("v1/event_channels/")
        name = f"pod-{rest.rsplit('/', 1)[1]}"
        base["metadata"]["name"] = name
        base["spec"]["data"]["event_channels"] = {rest: json.loads(value)}
        self.set(base)
        return lambda: self.delete(name)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                api.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                with api._lock:
                    if api.refusal is not None:
                        code, body = api.refusal
                    elif urlsplit(self.path).path == COLLECTION.format(ns=api.namespace):
                        code, body = 200, json.dumps({
                            "apiVersion": "nvidia.com/v1alpha1", "kind": "DynamoWorkerMetadataList",
                            "metadata": {"resourceVersion": str(api._version)},
                            "items": list(api.documents.values())}).encode()
                    else:  # another namespace holds none: an empty list, as the server answers
                        code, body = 200, json.dumps({"apiVersion": "nvidia.com/v1alpha1", "items": [],
                                                      "kind": "DynamoWorkerMetadataList", "metadata": {}}).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        return Handler


def status(code: int, reason: str, message: str) -> tuple[int, bytes]:
    """A refusal as the API server words it: a v1 Status."""
    return code, json.dumps({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                             "message": message, "reason": reason, "code": code}).encode()
