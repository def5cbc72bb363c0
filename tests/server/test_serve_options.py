"""`ServeOptions`, `NatsOptions` and `ZmqOptions` are keyword-only: with ten and twenty-odd fields, many of one type, a
positional call that shifts by one would still type-check and start a router that does something else."""

from __future__ import annotations

import pytest

from kvctl.nats.connection import NatsConnection
from kvctl.server.daemon import ServeOptions
from kvctl.server.plane.nats_plane import NatsOptions
from kvctl.server.plane.zmq_plane import ZmqOptions


def test_serve_options_refuse_positional_arguments() -> None:
    with pytest.raises(TypeError, match="positional"):
        ServeOptions("127.0.0.1", 7433)  # type: ignore[misc]
    assert ServeOptions(host="::1", port=0).port == 0


def test_nats_options_refuse_positional_arguments() -> None:
    connection = NatsConnection("nats://127.0.0.1:4222")
    with pytest.raises(TypeError, match="positional"):
        NatsOptions(connection, "dynamo")  # type: ignore[misc]
    assert NatsOptions(connection=connection, namespace="ns").namespace == "ns"


def test_zmq_options_refuse_positional_arguments() -> None:
    with pytest.raises(TypeError, match="positional"):
        ZmqOptions("file:/tmp/discovery", "dynamo")  # type: ignore[misc]
    assert ZmqOptions(discovery="file:/tmp/discovery", namespace="ns").namespace == "ns"
