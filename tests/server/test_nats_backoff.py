"""The router's reconnect pace: 0.1 s doubling up to 10 s, then 10 s for as long as NATS stays away (hours too)."""

from __future__ import annotations

from urllib.parse import urlparse

import pytest
from nats.aio.client import Server

from kvctl.server.plane.nats_plane import BACKOFF


def test_the_backoff_doubles_up_to_its_cap() -> None:
    assert [BACKOFF.delay(n) for n in range(9)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 10.0, 10.0])


def test_a_long_outage_keeps_the_cap_rather_than_overflowing() -> None:
    """nats-py counts failed tries per server: after 1,024 (about three hours at 10 s) 0.1 * 2**n overflowed a float,
    and nats-py retried at once, in a tight loop, after each OverflowError its hook raised."""
    server = Server(uri=urlparse("nats://127.0.0.1:4222"), reconnects=5000)
    assert BACKOFF.choose([server], {}) == (server, 10.0)
