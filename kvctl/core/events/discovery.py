"""Dynamo 1.6.1's discovery records of its ZMQ event plane (docs/contract.md): where each publisher listens.

Every publisher registers one `EventChannel` record per topic under
`v1/event_channels/namespace/{ns}/component/{comp}/endpoint/{ep}/topic/{topic}/{publisher_id hex}` (etcd: that
key; file discovery: the file `v1/event_channels/<the rest, percent-encoded>` under `DYN_FILE_KV`). A
subscriber lists and watches these, and connects a SUB socket to each record's `tcp://HOST:PORT`. Parsing only:
the listing and watching are the server's.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Collection
from dataclasses import dataclass

from kvctl.core.events.errors import DecodeError, ErrorKind, as_map, as_text, describe, parse_json, require

CHANNELS_BUCKET = "v1/event_channels"
_U64_MAX = (1 << 64) - 1
_KEY = re.compile(r"^namespace/([^/]+)/component/([^/]+)/endpoint/([^/]+)/topic/([^/]+)/([0-9a-f]{1,16})$")
_ESCAPE = re.compile(r"%([0-9A-Fa-f]{2})")
_BROADCAST = "255.255.255.255"


@dataclass(frozen=True, slots=True)
class ChannelKey:
    """Where a record is filed: its scope, topic and publisher (the key's last part, in lowercase hex)."""

    namespace: str
    component: str
    endpoint: str
    topic: str
    publisher_id: int

    @property
    def key(self) -> str:
        """The key as etcd holds it (no leading slash)."""
        return (f"{CHANNELS_BUCKET}/namespace/{self.namespace}/component/{self.component}/endpoint/{self.endpoint}"
                f"/topic/{self.topic}/{self.publisher_id:x}")


@dataclass(frozen=True, slots=True)
class EventChannel:
    """One publisher of one topic: its scope, and the ZMQ endpoint its PUB socket advertises."""

    namespace: str
    component: str
    endpoint: str
    topic: str
    publisher_id: int  # the record's `instance_id`: the envelopes' publisher_id
    address: str  # tcp://HOST:PORT

    @property
    def key(self) -> ChannelKey:
        return ChannelKey(self.namespace, self.component, self.endpoint, self.topic, self.publisher_id)


def namespace_prefix(namespace: str) -> str:
    """The key prefix of every channel of a namespace (what a subscriber lists and watches)."""
    return f"{CHANNELS_BUCKET}/namespace/{namespace}/"


def parse_channel_key(key: str) -> ChannelKey:
    """A key (`v1/event_channels/...`, or the part after the bucket) read into its parts; a key of another
    layout is a bad_type DecodeError."""
    rest = key.removeprefix(CHANNELS_BUCKET + "/")
    m = _KEY.match(rest)
    if m is None:
        raise DecodeError(ErrorKind.bad_type, "key", f"not an event-channel key: {describe(key)}")
    ns, comp, ep, topic, hex_id = m.groups()
    return ChannelKey(ns, comp, ep, topic, int(hex_id, 16))


def parse_event_channel(data: bytes | str) -> EventChannel:
    """An `EventChannel` record (JSON). A record of another type or transport is unknown_type; a missing or
    mistyped field missing_field / bad_type."""
    obj = as_map(parse_json(data), "record")
    kind = require(obj, "type")
    if kind != "EventChannel":
        raise DecodeError(ErrorKind.unknown_type, "type", f"expected EventChannel, got {describe(kind)}")
    scope = as_map(require(obj, "scope"), "scope")
    if scope.get("kind") != "endpoint":
        raise DecodeError(ErrorKind.unknown_type, "scope.kind", f"expected endpoint, got {describe(scope.get('kind'))}")
    where = as_map(require(scope, "endpoint", "scope.endpoint"), "scope.endpoint")
    transport = as_map(require(obj, "transport"), "transport")
    if transport.get("kind") != "Zmq":
        raise DecodeError(ErrorKind.unknown_type, "transport.kind",
                          f"expected Zmq, got {describe(transport.get('kind'))}")
    address = as_text(require(as_map(require(transport, "config", "transport.config"), "transport.config"), "endpoint",
                           "transport.config.endpoint"), "transport.config.endpoint")
    if not re.fullmatch(r"tcp://[^\s/]+:\d{1,5}", address):
        raise DecodeError(ErrorKind.bad_type, "transport.config.endpoint", f"expected tcp://HOST:PORT, got "
                                                                          f"{describe(address)}")
    instance_id = require(obj, "instance_id")
    if type(instance_id) is not int or not 0 <= instance_id <= _U64_MAX:
        raise DecodeError(ErrorKind.bad_type, "instance_id", f"expected a u64, got {describe(instance_id)}")
    return EventChannel(
        namespace=as_text(require(where, "namespace", "scope.endpoint.namespace"), "scope.endpoint.namespace"),
        component=as_text(require(where, "component", "scope.endpoint.component"), "scope.endpoint.component"),
        endpoint=as_text(require(where, "name", "scope.endpoint.name"), "scope.endpoint.name"),
        topic=as_text(require(obj, "topic"), "topic"),
        publisher_id=instance_id,
        address=address,
    )


def address_host(host: str) -> str:
    """A host as `unreachable` compares it: an IP literal in its one canonical form, a name in lowercase."""
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return host.lower()


def unreachable(address: str, own: Collection[tuple[str, int]] = ()) -> str | None:
    """Why a SUB socket must not connect to a record's `tcp://HOST:PORT` (a loss cause), or None when it may.
    A bind address (`*`, 0.0.0.0, ::) is where a publisher listens, not where it is reached (0.0.0.0 even
    connects to this host); port 0, a port past 65535, a multicast or broadcast address reach no publisher; and
    `own`, this router's HTTP listen addresses (`address_host`, port), would answer each ZMQ greeting with an
    HTTP error, logged on every reconnect, for ever."""
    host, _, port_text = address.removeprefix("tcp://").rpartition(":")
    port = int(port_text)
    if host in ("*", ""):
        return "wildcard_address"
    try:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        ip = None
    if ip is not None and ip.is_unspecified:
        return "wildcard_address"
    if not 0 < port <= 65535 or ip is not None and (ip.is_multicast or ip == ipaddress.IPv4Address(_BROADCAST)):
        return "unroutable_address"
    if (address_host(host), port) in own:
        return "own_address"
    return None


def encode_file_name(key: str) -> str:
    """Dynamo's file backend's name for a key (the part below its bucket): every character but ASCII
    letters and digits percent-encoded, UTF-8 bytes in uppercase hex."""
    return "".join(c if c.isascii() and c.isalnum() else "".join(f"%{b:02X}" for b in c.encode()) for c in key)


def decode_file_name(name: str) -> str:
    """The key a file-backend file name stands for; a name that is not its encoding is a bad_type DecodeError
    (a stray file: an editor's swap file, a half-written temporary)."""
    try:
        key = _ESCAPE.sub(lambda m: chr(int(m[1], 16)), name).encode("latin-1").decode()
    except (UnicodeEncodeError, UnicodeDecodeError):
        key = None
    if key is None or encode_file_name(key) != name:
        raise DecodeError(ErrorKind.bad_type, "file name", f"not a percent-encoded key: {describe(name)}")
    return key

