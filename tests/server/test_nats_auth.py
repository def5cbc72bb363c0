"""The event plane's connection options against real nats-servers that demand them: token, user and
password, nkey, and TLS with a private CA. Wrong credentials leave the router up, retrying, and saying
why in its status."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import nkeys
import pytest

from kvctl.nats.connection import NatsConnection
from kvctl.server.ingest.streams import Streams
from kvctl.server.plane.nats_plane import EventPlane, NatsOptions
from kvctl.server.state import Fleet
from tests.nats_server import NatsServer


def _conf(tmp: Path, body: str) -> Path:
    path = tmp / "nats.conf"
    path.write_text(body)
    return path


def _nkey_user(tmp: Path) -> tuple[str, Path]:
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    path = tmp / "user.nk"
    path.write_bytes(seed)
    return nkeys.from_seed(bytearray(seed)).public_key.decode(), path


def _tls(tmp: Path) -> tuple[Path, Path, Path]:
    """A private CA and a server certificate for 127.0.0.1 signed by it."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=tmp, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=kvctl test CA")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
            "-subj", "/CN=127.0.0.1")
    (tmp / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.pem", "-days", "1", "-extfile", "san.ext")
    return tmp / "ca.pem", tmp / "server.pem", tmp / "server.key"


@pytest.fixture(params=["token", "user", "nkey", "tls"])
def secured(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[NatsServer, dict, dict]]:
    """(server, options that get in, options that do not)."""
    mode = request.param
    if mode == "token":
        conf, good, bad = "authorization { token: s3cret }", {"token": "s3cret"}, {"token": "wrong"}
    elif mode == "user":
        conf = 'authorization { users = [ {user: alice, password: "pw"} ] }'
        good, bad = {"user": "alice", "password": "pw"}, {"user": "alice", "password": "nope"}
    elif mode == "nkey":
        public, seed_file = _nkey_user(tmp_path)
        (tmp_path / "other").mkdir()
        _, other = _nkey_user(tmp_path / "other")
        conf, good, bad = f"authorization {{ users = [ {{nkey: {public}}} ] }}", {"nkey": seed_file}, {"nkey": other}
    else:
        ca, cert, key = _tls(tmp_path)
        conf = f'tls {{ cert_file: "{cert}", key_file: "{key}" }}'
        good, bad = {"tls_ca": ca}, {}  # without the CA the server's certificate is not trusted
    srv = NatsServer(tmp_path / "store", "-c", str(_conf(tmp_path, conf)))
    yield srv, good, bad
    srv.stop()


async def _plane(server: NatsServer, **kw: object) -> tuple[EventPlane, Streams]:
    fleet = Fleet()
    streams = Streams(fleet)
    connection = NatsConnection(server.url, connect_timeout_s=1.0, **kw)  # type: ignore[arg-type]
    plane = EventPlane(fleet, streams, NatsOptions(connection=connection, namespace="auth"))
    plane.start()
    return plane, streams


async def test_connection_options_get_in_and_wrong_ones_are_reported(secured: tuple[NatsServer, dict, dict],
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    server, good, bad = secured
    plane, streams = await _plane(server, **good)
    try:
        assert await plane.ready(10), plane.status()
        assert plane.status()["state"] == "connected"
    finally:
        await plane.close()
        await streams.close()
    plane, streams = await _plane(server, **bad)
    try:
        assert not await plane.ready(1.5)
        status = plane.status()
        assert status["state"] == "connecting" and status["last_error"], status
        # and the log says it too, once, not once per retry (nats-py may word one refusal two ways)
        said = [r.getMessage() for r in caplog.records if r.name == "kvctl.serve" and "retrying" in r.getMessage()]
        assert any(status["last_error"] in line for line in said), said
        assert len(said) == len(set(said)) <= 2, said
    finally:
        await plane.close()
        await streams.close()
