"""`--nats-creds` (a .creds file: user JWT + nkey seed) against a real nats-server in operator mode, with
the operator, account and user JWTs signed here; and TLS with user/password demanded by one server.

Like test_nats_auth.py: the right credentials get in; wrong ones leave the router up, retrying, and saying
why in its status. A file that is not a .creds file at all is refused before anything starts: nats-py
would crash the event plane (no seed) or spin forever inside the event loop (no JWT) on it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import nkeys
import pytest

from kvctl.nats.connection import NatsConnection
from kvctl.server.ingest.streams import Streams
from kvctl.server.plane.nats_plane import EventPlane, NatsOptions
from kvctl.server.state import Fleet
from tests.nats_server import NatsServer
from tests.server.test_nats_auth import _tls
from tests.server.test_serve_process import refused
from tests.support import eventually_async

UNLIMITED = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True, "conn": -1,
             "leaf": -1}
JETSTREAM = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _keys(prefix: int) -> tuple[bytes, nkeys.KeyPair]:
    seed = nkeys.encode_seed(os.urandom(32), prefix)
    return seed, nkeys.from_seed(bytearray(seed))


def _public(kp: nkeys.KeyPair) -> str:
    return kp.public_key.decode()


def _jwt(signer: nkeys.KeyPair, subject: str, name: str, nats: dict[str, Any], **claims: Any) -> str:
    """A NATS JWT v2: ed25519-nkey signature over header.claims, jti the base32 hash of the claims."""
    body = {"iat": int(time.time()), "iss": _public(signer), "name": name, "sub": subject, "nats": nats, **claims}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).digest()
    body["jti"] = base64.b32encode(digest).decode().rstrip("=")
    header = {"typ": "JWT", "alg": "ed25519-nkey"}
    signing_input = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(body).encode())}"
    return f"{signing_input}.{_b64(signer.sign(signing_input.encode()))}"


def _creds(path: Path, jwt: str, seed: bytes) -> Path:
    path.write_text(f"-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n"
                    "************************* IMPORTANT *************************\n"
                    "NKEY Seed printed below can be used to sign and prove identity.\n\n"
                    f"-----BEGIN USER NKEY SEED-----\n{seed.decode()}\n------END USER NKEY SEED------\n")
    return path


class Operator:
    """An operator, a system account and an application account (JetStream enabled), preloaded into a
    nats-server's memory resolver; issues users' .creds files."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        _, self.operator = _keys(nkeys.PREFIX_BYTE_OPERATOR)
        _, system = _keys(nkeys.PREFIX_BYTE_ACCOUNT)
        _, self.account = _keys(nkeys.PREFIX_BYTE_ACCOUNT)
        op = self.operator
        accounts = {
            _public(system): _jwt(op, _public(system), "SYS", {"type": "account", "version": 2, "limits": UNLIMITED}),
            _public(self.account): _jwt(op, _public(self.account), "app", {
                "type": "account", "version": 2, "limits": {**UNLIMITED, **JETSTREAM}}),
        }
        (tmp / "op.jwt").write_text(_jwt(op, _public(op), "kvctl-test", {
            "type": "operator", "version": 2, "system_account": _public(system)}))
        preload = "\n".join(f'  {public}: "{jwt}"' for public, jwt in accounts.items())
        self.conf = tmp / "operator.conf"
        self.conf.write_text(f'operator: "{tmp / "op.jwt"}"\nsystem_account: {_public(system)}\n'
                             f"resolver: MEMORY\nresolver_preload: {{\n{preload}\n}}\n")

    def user(self, name: str, *, account: nkeys.KeyPair | None = None, seed: bytes | None = None,
             **claims: Any) -> Path:
        """`name`.creds for a new user of `account` (default: the preloaded one); `seed`: put another key's
        seed in the file instead of the user's own."""
        own_seed, user = _keys(nkeys.PREFIX_BYTE_USER)
        jwt = _jwt(account or self.account, _public(user), name, {
            "type": "user", "version": 2, "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1}, **claims)
        return _creds(self.tmp / f"{name}.creds", jwt, seed or own_seed)


@pytest.fixture(scope="module")
def operator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsServer, Operator]]:
    tmp = tmp_path_factory.mktemp("operator")
    issuer = Operator(tmp)
    server = NatsServer(tmp / "store", "-c", str(issuer.conf))
    try:
        yield server, issuer
    finally:
        server.stop()


@asynccontextmanager
async def _plane(url: str, *, jetstream: bool = False, **kw: Any) -> AsyncIterator[EventPlane]:
    fleet = Fleet()
    streams = Streams(fleet)
    plane = EventPlane(fleet, streams, NatsOptions(connection=NatsConnection(url, connect_timeout_s=1.0, **kw),
                                                   namespace="creds", router_id=7, jetstream=jetstream))
    plane.start()
    try:
        yield plane
    finally:
        await plane.close()
        await streams.close()


async def _refused(plane: EventPlane, why: str) -> None:
    """The plane's status comes to say `why` it is not in, while it keeps trying. (A first attempt can end
    in a connection reset: the server sends its -ERR and closes at once; a later one reads the -ERR.)"""
    status = await eventually_async(plane.status, f"the plane's last error to say {why!r}",
                                    until=lambda s: why in (s["last_error"] or "").lower())
    assert status["state"] == "connecting" and not status["ready"] and status["connects"] == 0, status


@pytest.mark.parametrize("jetstream", [False, True], ids=["core", "jetstream"])
async def test_creds_file_gets_in(operator: tuple[NatsServer, Operator], jetstream: bool) -> None:
    server, issuer = operator
    async with _plane(server.url, creds=issuer.user(f"router-{jetstream}"), jetstream=jetstream) as plane:
        assert await plane.ready(10), plane.status()
        assert plane.status()["state"] == "connected" and plane.status()["last_error"] is None


def _stranger(issuer: Operator) -> Path:
    _, unknown_account = _keys(nkeys.PREFIX_BYTE_ACCOUNT)
    return issuer.user("stranger", account=unknown_account)


def _wrong_seed(issuer: Operator) -> Path:
    other_seed, _ = _keys(nkeys.PREFIX_BYTE_USER)
    return issuer.user("impostor", seed=other_seed)


def _expired(issuer: Operator) -> Path:
    return issuer.user("expired", exp=int(time.time()) - 60)


@pytest.mark.parametrize("make", [_stranger, _wrong_seed, _expired], ids=["unknown-account", "wrong-seed", "expired"])
async def test_wrong_creds_are_reported_and_the_plane_keeps_trying(operator: tuple[NatsServer, Operator],
                                                                   make: Any) -> None:
    server, issuer = operator
    async with _plane(server.url, creds=make(issuer)) as plane:
        await _refused(plane, "authorization violation")


async def test_tls_and_user_password_in_one_server(tmp_path: Path) -> None:
    ca, cert, key = _tls(tmp_path)
    conf = tmp_path / "nats.conf"
    conf.write_text(f'tls {{ cert_file: "{cert}", key_file: "{key}" }}\n'
                    'authorization { users = [ {user: alice, password: "tls-and-pw"} ] }\n')
    server = NatsServer(tmp_path / "store", "-c", str(conf))
    try:
        async with _plane(server.url, tls_ca=ca, user="alice", password="tls-and-pw") as plane:
            assert await plane.ready(10), plane.status()
        async with _plane(server.url, tls_ca=ca, user="alice", password="wrong") as plane:
            await _refused(plane, "authorization violation")
        async with _plane(server.url, user="alice", password="tls-and-pw") as plane:  # the CA is not trusted
            await _refused(plane, "certificate verify failed")
    finally:
        server.stop()


def _seed_only(tmp: Path, _: Operator) -> tuple[str, Path]:
    seed, _kp = _keys(nkeys.PREFIX_BYTE_USER)
    (tmp / "user.nk").write_bytes(seed)
    return "--nats-creds", tmp / "user.nk"


def _jwt_only(tmp: Path, issuer: Operator) -> tuple[str, Path]:
    text = issuer.user("half").read_text()
    (tmp / "half.creds").write_text(text[:text.index("*")])
    return "--nats-creds", tmp / "half.creds"


def _bad_seed(tmp: Path, issuer: Operator) -> tuple[str, Path]:
    return "--nats-creds", _creds(tmp / "bad.creds", issuer.user("bad").read_text().splitlines()[1], b"SUNOTASEED")


def _bad_nkey(tmp: Path, _: Operator) -> tuple[str, Path]:
    (tmp / "bad.nk").write_text("not a seed\n")
    return "--nats-nkey", tmp / "bad.nk"


@pytest.mark.parametrize("make", [_seed_only, _jwt_only, _bad_seed, _bad_nkey],
                         ids=["seed-only", "jwt-only", "bad-seed", "bad-nkey"])
def test_a_file_that_is_not_credentials_exits_2_before_serving(tmp_path: Path, operator: tuple[NatsServer, Operator],
                                                                make: Any) -> None:
    server, issuer = operator
    flag, path = make(tmp_path, issuer)
    code, out, err = refused("--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state"), "--nats", server.url,
                             flag, str(path))
    assert code == 2 and out == "", (out, err)
    assert flag in err and str(path) in err and len(err.strip().splitlines()) == 1, err
