"""This router's in-flight requests on Dynamo's ZMQ event plane (`--replica-sync`), shared as a Dynamo router
shares its own (docs/contract.md).

For each scope (component, endpoint) of the workers it follows, the router binds a PUB socket and files an
`EventChannel` record for `active_sequences_events` under that scope; Dynamo's routers of that scope list the
record, connect, and take this router's add / prefill complete / free as they take each other's. Each goes out
as a one-event batch `{"events": [...]}` in the envelope, in Dynamo's four frames, with a publisher id and
sequence of its socket's own. A `--shadow` router makes none of this.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any

import zmq

from kvctl.core.events.discovery import ChannelKey
from kvctl.core.events.dynamo import EnvelopeWriter
from kvctl.core.events.plane import ACTIVE_SEQUENCES, ActiveSequenceEvent, encode_sequence_events
from kvctl.core.events.zmq_wire import ZmqMessage, encode_zmq_message
from kvctl.server.plane.dynamo_discovery import Discovery
from kvctl.zmq_limits import limited

log = logging.getLogger("kvctl.serve")

Scope = tuple[str, str]  # (component, endpoint)
SNDHWM = 100_000
"""Messages a PUB socket holds for a slow subscriber; beyond, ZMQ drops them (the subscriber sees a gap)."""
SUBSCRIPTION_MAX_BYTES = 64 * 1024
"""The most a peer may send this router's PUB: only subscriptions come in (a topic prefix; Dynamo's routers
subscribe to everything). libzmq drops a peer that sends more; a peer connects to us, so it is its to connect
again, and the drop, indistinguishable here from a peer leaving, is not counted."""


def default_advertise_host() -> str:
    """The address Dynamo's processes would advertise for this host: the one its default route leaves from
    (no packet is sent: a UDP connect only picks the route), else 127.0.0.1."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed anywhere, only looked up
        return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()


@dataclass(eq=False)
class _Outlet:
    """One scope's PUB socket and its record."""

    scope: Scope
    key: ChannelKey
    address: str
    socket: zmq.Socket[bytes]
    writer: EnvelopeWriter
    sent: int = 0

    def row(self) -> dict[str, Any]:
        return {"component": self.scope[0], "endpoint": self.scope[1], "channel": self.key.key,
                "address": self.address, "publisher_id": self.key.publisher_id, "sent": self.sent}


class SequenceChannels:
    """The PUB sockets and discovery records of this router's `active_sequences_events`, one per scope."""

    def __init__(self, discovery: Discovery, namespace: str, router_id: int, advertise_host: str,
                 bind_host: str = "0.0.0.0") -> None:
        self.discovery = discovery
        self.namespace = namespace
        self.router_id = router_id
        self.advertise_host = advertise_host
        self.bind_host = bind_host
        self.unplaced = 0  # events for a worker never heard of on the plane: no scope to send them to
        self._outlets: dict[Scope, _Outlet] = {}
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()

    async def open(self, scopes: set[Scope]) -> None:
        """A socket and a record for each scope not served yet (a scope whose workers went keeps its own:
        the workers of a scope come back under it)."""
        for scope in sorted(scopes - self._outlets.keys()):
            sock = limited(self._ctx.socket(zmq.PUB), SUBSCRIPTION_MAX_BYTES)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, SNDHWM)
            port = sock.bind_to_random_port(f"tcp://{self.bind_host}")
            publisher_id = secrets.randbits(53)  # Dynamo's instance ids are below 2^53 too (JSON-safe)
            key = ChannelKey(self.namespace, scope[0], scope[1], ACTIVE_SEQUENCES, publisher_id)
            outlet = _Outlet(scope, key, f"tcp://{self.advertise_host}:{port}", sock,
                             EnvelopeWriter(publisher_id, ACTIVE_SEQUENCES))
            self._outlets[scope] = outlet
            await self.discovery.register(key.key, self._record(outlet))
            log.info("event plane: sharing this router's requests for %s/%s at %s (%s)", *scope, outlet.address,
                     key.key)

    def _record(self, outlet: _Outlet) -> bytes:
        """The `EventChannel` record a Dynamo router files for its replica-sync channel."""
        return json.dumps({
            "type": "EventChannel",
            "scope": {"kind": "endpoint", "endpoint": {"namespace": self.namespace, "component": outlet.scope[0],
                                                       "name": outlet.scope[1]}},
            "topic": ACTIVE_SEQUENCES, "instance_id": outlet.key.publisher_id,
            "transport": {"kind": "Zmq", "config": {"endpoint": outlet.address}},
        }, separators=(",", ":")).encode()

    def publish(self, scope: Scope | None, event: ActiveSequenceEvent) -> None:
        """Send one event to the routers of its worker's scope (never blocks: a full queue drops, as PUB does)."""
        outlet = None if scope is None else self._outlets.get(scope)
        if outlet is None:
            self.unplaced += 1
            return
        sequence = outlet.writer.sequence  # the frame repeats the envelope's
        envelope = outlet.writer.wrap(encode_sequence_events([event]), int(time.time() * 1000))
        frames = encode_zmq_message(ZmqMessage(ACTIVE_SEQUENCES, outlet.key.publisher_id, sequence, envelope))
        try:
            outlet.socket.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            return
        outlet.sent += 1

    def rows(self) -> list[dict[str, Any]]:
        return [outlet.row() for _, outlet in sorted(self._outlets.items())]

    def close(self) -> None:
        """The sockets; the records go with the discovery store's close."""
        for outlet in self._outlets.values():
            outlet.socket.close(linger=0)
        self._outlets.clear()
        self._ctx.destroy(linger=0)
