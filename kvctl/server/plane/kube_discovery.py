"""Dynamo's Kubernetes discovery backend (docs/contract.md): `--dynamo-discovery kubernetes[:NAMESPACE]`.

Each Dynamo worker server-side-applies one `DynamoWorkerMetadata` custom resource (nvidia.com/v1alpha1,
namespaced, named after its pod and owned by it) whose `spec.data` is its whole discovery metadata:
`{endpoints, model_cards, event_channels, event_sources}`. In 1.6.1 the `event_channels` map is keyed by the
etcd key of each record less its `v1/event_channels/` bucket (recorded: tests/fixtures/dynamo-1.6.1-fleet/
kubernetes), so a listing of the namespace's resources yields the same keys and values as file and etcd discovery.
The API server is the one kube-rs (Dynamo's client) would pick: `$KUBECONFIG` or ~/.kube/config first, else
the pod's service account. Lists are read from the API server's watch cache (`resourceVersion=0`): a poll
every half second must not reach etcd. Only reading: Dynamo counts a resource only for a pod that is ready in
a labelled EndpointSlice, which kvctl cannot make itself, so it files no records of its own here.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import json
import os
import re
import ssl
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvctl.core.events.discovery import CHANNELS_BUCKET, parse_channel_key
from kvctl.core.events.errors import DecodeError
from kvctl.core.events.model_card import CARDS_BUCKET, is_card_key_rest
from kvctl.core.events.request_plane import SOURCES_BUCKET
from kvctl.errors import DiscoveryError
from kvctl.server.plane.discovery_limits import IDENTITY, MAX_RECORD_BYTES, Refusals, TooLarge, read_capped
from kvctl.server.plane.dynamo_discovery import polled

GROUP, VERSION, PLURAL = "nvidia.com", "v1alpha1", "dynamoworkermetadatas"
API_TIMEOUT_S = 5.0
API_CALL_S = 15.0
"""The longest one page of the list may take, connect to last byte: an API server that trickles its answer fails
the listing (retried) rather than holding it for ever."""
MAX_PAGE_BYTES = 64 << 20
"""The largest page of the list read: a worker's document (model cards included) is tens of KB, so this is
thousands of workers; past it the listing fails, named, rather than growing the router without bound."""
BUCKETS = {CHANNELS_BUCKET: "event_channels", SOURCES_BUCKET: "event_sources", CARDS_BUCKET: "model_cards"}
"""Each bucket a store lists, and where a DynamoWorkerMetadata's `spec.data` holds its records."""


def _key_layout_ok(bucket: str, rest: str) -> bool:
    """Whether a record's key (less its bucket) has its bucket's layout: channels and sources are filed by scope
    and topic (Dynamo 1.2's `ns/component/topic/id` is not), cards by scope and instance."""
    if bucket == CARDS_BUCKET:
        return is_card_key_rest(rest)
    try:
        parse_channel_key(rest)  # the same layout in either bucket
    except DecodeError:
        return False
    return True
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where a pod's service-account token, CA and namespace are mounted."""
NAMESPACE_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
RBAC_HINT = (f"this identity needs RBAC `list` on {PLURAL}.{GROUP} in namespace {{ns}} (a Role with apiGroups "
             f"[{GROUP}], resources [{PLURAL}], verbs [list], bound to it)")


@dataclass(frozen=True)
class ApiServer:
    """Where and as whom to ask: the API server's URL, its credentials, and the namespace by default."""

    server: str
    namespace: str
    source: str  # the file or mount the settings came from, for error messages
    token: str | None = None
    token_file: Path | None = None  # re-read on each call: projected service-account tokens rotate
    verify: ssl.SSLContext | None = None  # None: the system's CAs

    def headers(self) -> dict[str, str]:
        token = self.token
        if self.token_file is not None:
            try:
                token = self.token_file.read_text().strip()
            except OSError as exc:
                raise DiscoveryError(f"cannot read the token {self.token_file}: {exc.strerror}") from None
        return {"Authorization": f"Bearer {token}"} if token else {}


def load_api_server() -> ApiServer:
    """The API server from `$KUBECONFIG` (its files merged as kubectl merges them: the first to set a name
    wins) or ~/.kube/config, else the pod's service account; DiscoveryError naming the fix when neither is
    there or the file cannot be used."""
    named = [Path(p) for p in os.environ.get("KUBECONFIG", "").split(os.pathsep) if p]
    files = [f for f in named or [Path.home() / ".kube" / "config"] if f.is_file()]
    if files:
        return _from_kubeconfig(files)
    if os.environ.get("KUBERNETES_SERVICE_HOST") and (SERVICE_ACCOUNT / "token").is_file():
        return _in_cluster()
    raise DiscoveryError("no Kubernetes API server configured: set KUBECONFIG (or write ~/.kube/config), or run "
                         "kvctl in a pod with a service account")


def _in_cluster() -> ApiServer:
    host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    host = f"[{host}]" if ":" in host else host
    ns_file = SERVICE_ACCOUNT / "namespace"
    namespace = ns_file.read_text().strip() if ns_file.is_file() else "default"
    ca = SERVICE_ACCOUNT / "ca.crt"
    return ApiServer(f"https://{host}:{port}", namespace, str(SERVICE_ACCOUNT), token_file=SERVICE_ACCOUNT / "token",
                     verify=_tls(str(ca) if ca.is_file() else None, None, None, None, insecure=False))


def _from_kubeconfig(files: list[Path]) -> ApiServer:
    source = os.pathsep.join(map(str, files))
    docs = []
    for f in files:
        try:
            doc = yaml.safe_load(f.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise DiscoveryError(f"cannot read the kubeconfig {f}: {exc}") from None
        if not isinstance(doc, dict):
            raise DiscoveryError(f"{f} is not a kubeconfig")
        docs.append((f.parent, doc))
    current = next((d["current-context"] for _, d in docs if d.get("current-context")), None)
    if current is None:
        raise DiscoveryError(f"{source}: no current-context (kubectl config use-context NAME)")
    context = _named(docs, "contexts", "context", current, source)[1]
    where, cluster = _named(docs, "clusters", "cluster", context.get("cluster"), source)
    user_dir, user = _named(docs, "users", "user", context.get("user"), source) if context.get("user") else (where, {})
    if "exec" in user or "auth-provider" in user:
        raise DiscoveryError(f"{source}: user {context.get('user')!r} authenticates through an exec plugin or "
                             "auth provider, which kvctl does not run: give it a token (a service account's) "
                             "or a client certificate")
    server = cluster.get("server")
    if not isinstance(server, str) or not server.startswith(("http://", "https://")):
        raise DiscoveryError(f"{source}: cluster {context.get('cluster')!r} has no http(s) server")
    verify = _tls(_path(where, cluster.get("certificate-authority")), cluster.get("certificate-authority-data"),
                  _pem(user_dir, user, "client-certificate"), _pem(user_dir, user, "client-key"),
                  insecure=bool(cluster.get("insecure-skip-tls-verify")))
    token_file = _path(user_dir, user.get("tokenFile"))
    return ApiServer(server.rstrip("/"), context.get("namespace") or "default", source, token=user.get("token"),
                     token_file=Path(token_file) if token_file else None, verify=verify)


def _named(docs: list[tuple[Path, dict[str, Any]]], section: str, field: str, name: Any,
           source: str) -> tuple[Path, dict[str, Any]]:
    """The first entry of that name in the merged files, with the directory its relative paths are from."""
    for where, doc in docs:
        for entry in doc.get(section) or []:
            if isinstance(entry, dict) and entry.get("name") == name and isinstance(entry.get(field), dict):
                return where, entry[field]
    raise DiscoveryError(f"{source}: no {field} named {name!r}")


def _path(where: Path, value: Any) -> str | None:
    return str(where / value) if isinstance(value, str) and value else None


def _pem(where: Path, user: dict[str, Any], field: str) -> bytes | None:
    """A client certificate or key, from its file or its `-data` (base64) twin."""
    try:
        if user.get(f"{field}-data"):
            return base64.b64decode(user[f"{field}-data"])
        path = _path(where, user.get(field))
        return Path(path).read_bytes() if path else None
    except (OSError, ValueError) as exc:
        raise DiscoveryError(f"cannot read the kubeconfig's {field}: {exc}") from None


def _tls(ca_file: str | None, ca_data: str | None, cert: bytes | None, key: bytes | None, *,
         insecure: bool) -> ssl.SSLContext:
    """Verification against the cluster's CA (the system's when none is given; none with
    insecure-skip-tls-verify), and the client certificate."""
    try:
        ctx = ssl.create_default_context(cafile=ca_file,
                                         cadata=base64.b64decode(ca_data).decode() if ca_data else None)
        if insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if cert is not None and key is not None:
            with tempfile.TemporaryDirectory() as tmp:  # the ssl module loads certificates from files only
                cert_path, key_path = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
                cert_path.write_bytes(cert)
                key_path.write_bytes(key)
                ctx.load_cert_chain(cert_path, key_path)
    except (OSError, ValueError, ssl.SSLError) as exc:
        raise DiscoveryError(f"cannot load the cluster's TLS settings: {exc}") from None
    return ctx


class KubernetesDiscovery:
    """The `event_channels` of every DynamoWorkerMetadata of a namespace, as the keys and values etcd holds."""

    can_register = False

    def __init__(self, namespace: str | None) -> None:
        self.api = load_api_server()
        self.namespace = namespace or self.api.namespace
        self.url = f"kubernetes:{self.namespace}"
        self.refusals = Refusals()
        self.expired = 0  # a dead pod's resource is deleted with it (its owner)
        self.follows = "poll"
        self._client: httpx.AsyncClient | None = None  # made in the loop that lists

    def changes(self, prefix: str, poll_s: float) -> AsyncIterator[dict[str, bytes]]:
        return polled(self, prefix, poll_s)

    async def list(self, prefix: str) -> dict[str, bytes]:
        bucket = "/".join(prefix.split("/")[:2])
        field = BUCKETS.get(bucket)
        if field is None or not prefix.startswith(bucket + "/"):
            raise ValueError(f"only {', '.join(BUCKETS)} keys are listed, not {prefix!r}")
        found: dict[str, bytes] = {}
        refused: set[str] = set()

        def refuse(entry: str, version: str, cause: str, detail: str) -> None:
            refused.add(entry)
            self.refusals.refuse(entry, version, cause, detail)

        for item in await self._items():
            name, version, channels = _records(item, field)
            if channels is None:
                refuse(f"{bucket}/{name}", version, "bad_document", f"{name}: no spec.data.{field} map")
                continue
            for rest, record in channels.items():
                key = f"{bucket}/{rest}"
                if not _key_layout_ok(bucket, rest):
                    cause = "bad_card_key" if bucket == CARDS_BUCKET else "bad_channel_key"
                    refuse(f"{bucket}/{name}/{rest}", version, cause, f"{name}: key {rest!r:.80}")
                    continue
                if not key.startswith(prefix):
                    continue
                value = json.dumps(record).encode()
                if len(value) > MAX_RECORD_BYTES:
                    refuse(f"{bucket}/{name}/{rest}", version, "too_large", f"{name}: {key} holds {len(value)} bytes")
                    continue
                found[key] = value
        self.refusals.forget(bucket + "/", refused)
        return found

    async def _items(self) -> builtins.list[Any]:  # `list` in this class is the method above
        """Every resource of the namespace, page by page (one page when served from the watch cache)."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=API_TIMEOUT_S, verify=self.api.verify or True, headers=IDENTITY)
        url = f"{self.api.server}/apis/{GROUP}/{VERSION}/namespaces/{self.namespace}/{PLURAL}"
        params = {"resourceVersion": "0"}
        items: list[Any] = []
        while True:
            page = self._page(*await self._get(url, params))
            items.extend(page["items"])
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items
            params = {"continue": token}

    async def _get(self, url: str, params: dict[str, str]) -> tuple[httpx.Response, bytes]:
        """One page: its answer and body, whole within API_CALL_S and at most MAX_PAGE_BYTES."""
        assert self._client is not None
        where = f"the Kubernetes API server {self.api.server} (from {self.api.source})"
        try:
            async with asyncio.timeout(API_CALL_S):
                answer = await self._client.send(self._client.build_request(
                    "GET", url, params=params, headers=self.api.headers()), stream=True)
                try:
                    return answer, await read_capped(answer, MAX_PAGE_BYTES)
                finally:
                    await answer.aclose()
        except (httpx.HTTPError, ssl.SSLError) as exc:  # a TLS alert read with the answer comes unwrapped
            raise DiscoveryError(f"cannot reach {where}: {type(exc).__name__}: {exc}") from None
        except TimeoutError:
            raise DiscoveryError(f"{where}: no whole answer within {API_CALL_S:g} s") from None
        except TooLarge as exc:
            raise DiscoveryError(f"{where}: a page of {PLURAL} past {MAX_PAGE_BYTES >> 20} MiB ({exc})") from None

    def _page(self, answer: httpx.Response, content: bytes) -> dict[str, Any]:
        """The list's body; DiscoveryError naming the fix for a refusal."""
        where = f"{self.api.server} namespace {self.namespace}"
        if answer.status_code == 401:
            raise DiscoveryError(f"{where}: the API server does not accept the credentials of {self.api.source} "
                                 "(401 Unauthorized): renew the token or certificate")
        if answer.status_code == 403:
            raise DiscoveryError(f"{where}: forbidden (403): {RBAC_HINT.format(ns=self.namespace)}")
        if answer.status_code == 404:
            raise DiscoveryError(f"{where}: no {PLURAL}.{GROUP} resource (404): install Dynamo's CRDs, or point "
                                 "at the cluster Dynamo runs in")
        try:
            body = json.loads(content)
        except ValueError:
            body = None
        text = content[:200].decode(errors="replace")
        if answer.status_code != 200:
            message = body.get("message") if isinstance(body, dict) else text
            raise DiscoveryError(f"{where}: HTTP {answer.status_code}: {message}")
        if not isinstance(body, dict) or not isinstance(body.get("items"), list):
            raise DiscoveryError(f"{where}: not a DynamoWorkerMetadataList: {text[:80]!r}")
        return body

    async def register(self, key: str, value: bytes) -> None:
        raise DiscoveryError("kvctl files no records through Kubernetes discovery: share replica sync through "
                             "file: or etcd: discovery, or observe only (--shadow)")

    async def keep_alive(self) -> None:
        """Nothing of this router's to refresh."""

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _records(item: Any, field: str) -> tuple[str, str, dict[str, Any] | None]:
    """A resource's name, version and `spec.data.{field}` (None when the document is not that shape)."""
    meta = item.get("metadata") if isinstance(item, dict) else None
    name = str(meta.get("name")) if isinstance(meta, dict) else repr(item)[:80]
    version = str(meta.get("resourceVersion")) if isinstance(meta, dict) else ""
    spec = item.get("spec") if isinstance(item, dict) else None
    data = spec.get("data") if isinstance(spec, dict) else None
    channels = data.get(field, {}) if isinstance(data, dict) else None
    return name, version, channels if isinstance(channels, dict) else None


def parse_kubernetes_url(where: str) -> str | None:
    """The namespace of `kubernetes[:NAMESPACE]` (None: the configuration's); ValueError for a bad name."""
    if where and not NAMESPACE_RE.fullmatch(where):
        raise ValueError(f"--dynamo-discovery kubernetes:NAMESPACE wants a Kubernetes namespace name, got {where!r}")
    return where or None
