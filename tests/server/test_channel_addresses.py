"""Which addresses of Dynamo's event-channel records a SUB socket may connect to (issue 36): a bind address
advertised as is (`tcp://*:5557`) once stopped the ZMQ plane for good, and a record naming the router's own HTTP
port made it reconnect there for ever, logging each failed greeting."""

from __future__ import annotations

import pytest

from kvctl.core.events.discovery import address_host, unreachable
from kvctl.server.plane.zmq_plane import own_addresses


@pytest.mark.parametrize(("address", "why"), [
    ("tcp://10.0.0.7:5557", None),
    ("tcp://worker-3.svc:5557", None),
    ("tcp://[fd00::7]:5557", None),
    ("tcp://*:5557", "wildcard_address"),
    ("tcp://0.0.0.0:5557", "wildcard_address"),
    ("tcp://[::]:5557", "wildcard_address"),
    ("tcp://10.0.0.7:0", "unroutable_address"),
    ("tcp://10.0.0.7:70000", "unroutable_address"),
    ("tcp://239.1.2.3:5557", "unroutable_address"),
    ("tcp://255.255.255.255:5557", "unroutable_address"),
])
def test_bind_and_unroutable_addresses_are_refused(address: str, why: str | None) -> None:
    assert unreachable(address) == why


def test_the_routers_own_http_address_is_refused_under_any_of_its_names() -> None:
    own = own_addresses(("0.0.0.0", 8080))  # listening on every address: any name of this host reaches it
    for address in ("tcp://127.0.0.1:8080", "tcp://localhost:8080", "tcp://LOCALHOST:8080", "tcp://[::1]:8080"):
        assert unreachable(address, own) == "own_address", address
    assert unreachable("tcp://127.0.0.1:8081", own) is None  # another port: a publisher's
    loopback = own_addresses(("127.0.0.1", 8080))
    assert unreachable("tcp://localhost:8080", loopback) == "own_address"
    assert unreachable("tcp://10.0.0.7:8080", loopback) is None  # not reached through a loopback listener
    assert address_host("[0:0:0:0:0:0:0:1]") == address_host("::1") and own_addresses(None) == frozenset()
