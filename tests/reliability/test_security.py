"""The router's security promises, each against the real thing: the admin token on every mutating
endpoint (found by enumerating the app, so an endpoint added later is covered without touching this
file), no non-loopback bind without a token, request bodies capped, and no secret in logs, status,
metrics or `kvctl config show`.

Real `kvctl serve` processes and a real nats-server demanding the credentials; NATS .creds files and TLS
with user auth are in tests/server/test_nats_creds.py.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import re
import secrets
import select
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from kvctl.cli import app as cli
from kvctl.server.http import api
from kvctl.server.http.api import create_app, openapi_document
from kvctl.server.state import Fleet
from tests.nats_server import NatsServer, free_port
from tests.server.test_serve_process import refused
from tests.support import eventually
from tests.support.served import on_both_route_paths

TOKEN = "adm-" + secrets.token_hex(12)
MUTATING = {"POST", "PUT", "PATCH", "DELETE"}
OPEN_MUTATIONS = {("POST", "/v1/route"), ("POST", "/v1/requests/{request_id}/prefill_complete"),
                  ("DELETE", "/v1/requests/{request_id}")}
"""The data plane's request lifecycle, answered without the token (tests/server/test_api.py pins route open)."""
KNOWN_ADMIN = {("POST", "/v1/workers"), ("DELETE", "/v1/workers/{worker_id}"), ("POST", "/v1/events"),
               ("POST", "/v1/reset"), ("POST", "/busy_threshold"), ("DELETE", "/busy_threshold")}
"""A floor, not the list: the enumeration below must find at least these."""


# ----- 1. the admin token on every mutating endpoint ------------------------------------------------------

def _routes(front: Any) -> set[tuple[str, str]]:
    """(method, path template) of every endpoint: the framework's routes plus what only the OpenAPI
    document declares (POST /v1/route is answered before the framework)."""
    found = {(method, route.path) for route in front.app.routes for method in getattr(route, "methods", None) or ()}
    schema = openapi_document()
    found |= {(method.upper(), path) for path, item in schema["paths"].items() for method in item}
    return found


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "1", path)


WRONG_HEADERS = {
    "none": None,
    "other token": "Bearer wrong",
    "prefix of it": f"Bearer {TOKEN[:-1]}",
    "same length": f"Bearer {TOKEN[:-1]}{'x' if TOKEN[-1] != 'x' else 'y'}",
    "it plus more": f"Bearer {TOKEN}x",
    "no scheme": TOKEN,
    "basic": f"Basic {TOKEN}",
    "empty bearer": "Bearer ",
}


@pytest.fixture
async def guarded() -> Any:
    front = create_app(Fleet(block_size=16, seed=0), admin_token=TOKEN)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=front), base_url="http://kvctl") as client:
        yield front, client


async def test_every_mutating_endpoint_needs_the_exact_admin_token(guarded: Any) -> None:
    front, client = guarded
    routes = _routes(front)
    mutations = {(m, p) for m, p in routes if m in MUTATING}
    assert mutations >= KNOWN_ADMIN | OPEN_MUTATIONS, sorted(mutations)
    for method, path in sorted(mutations - OPEN_MUTATIONS):
        url = _concrete(path)
        for why, header in WRONG_HEADERS.items():
            answer = await client.request(method, url, json={}, headers={"authorization": header} if header else {})
            assert answer.status_code == 401, (method, path, why, answer.text)
            assert "admin token" in answer.json()["error"]
            presented = header.split(" ", 1)[-1].strip() if header else ""
            assert TOKEN[:8] not in answer.text and (not presented or presented not in answer.text), answer.text
        right = await client.request(method, url, json={}, headers={"authorization": f"Bearer {TOKEN}"})
        assert right.status_code != 401, (method, path, right.text)
    for method, path in OPEN_MUTATIONS:
        answer = await client.request(method, _concrete(path), json={"token_ids": [1] * 16})
        assert answer.status_code != 401, (method, path, answer.text)


async def test_reads_need_no_token_and_unknown_mutations_are_denied(guarded: Any) -> None:
    front, client = guarded
    reads = sorted((m, p) for m, p in _routes(front) if m == "GET")
    assert {("GET", "/v1/status"), ("GET", "/v1/workers"), ("GET", "/metrics"), ("GET", "/v1/tree")} <= set(reads)
    for _, path in reads:
        answer = await client.get(_concrete(path))
        assert answer.status_code != 401, (path, answer.text)
    # Deny by default: paths no route declares, and spellings of guarded or open ones, still want the token.
    for method, path in [("POST", "/v1/some-future-endpoint"), ("PUT", "/v1/workers/1"), ("PATCH", "/v1/reset"),
                         ("POST", "/v1/events/"), ("POST", "//v1/events"), ("POST", "/v1/route/"),
                         ("DELETE", "/v1/route")]:
        assert (await client.request(method, path, json={})).status_code == 401, (method, path)


async def test_without_a_token_mutations_are_open(guarded: Any) -> None:
    """The other side of the guard: the 401s above come from the token, not from the requests."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(Fleet())), base_url="http://k") as c:
        assert (await c.post("/v1/reset", json={})).status_code == 200
        assert (await c.post("/v1/workers", json={"worker_id": 1})).status_code == 201


async def test_the_token_is_compared_in_constant_time(guarded: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every check of a presented token goes through hmac.compare_digest (secrets.compare_digest is the same
    function), whose time does not depend on where the first differing byte is."""
    _, client = guarded
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        compared.append((bytes(a), bytes(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    monkeypatch.setattr(secrets, "compare_digest", spy)
    monkeypatch.setattr(api, "compare_digest", spy, raising=False)
    for header in (f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}"):
        compared.clear()
        answer = await client.post("/v1/reset", json={}, headers={"authorization": header})
        assert answer.status_code == (200 if header.endswith(TOKEN) else 401)
        assert any(header.encode() in pair for pair in compared), compared


# ----- 2. no non-loopback bind without a token -----------------------------------------------------------

@dataclass
class Served:
    proc: subprocess.Popen[str]
    url: str  # as announced
    log: Path

    def client(self) -> httpx.Client:
        host, port = re.fullmatch(r"http://(\[.*\]|[^:]+):(\d+)", self.url).groups()  # type: ignore[union-attr]
        reach = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]"}.get(host, host)
        return httpx.Client(base_url=f"http://{reach}:{port}", timeout=5)

    def stop(self) -> str:
        """SIGTERM, a clean exit, and everything the process wrote to stdout and stderr."""
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=15) == 0
        return self.url + "\n" + self.proc.stdout.read() + self.log.read_text()  # type: ignore[union-attr]


@contextmanager
def serve(tmp: Path, listen: str, *args: str, env: dict[str, str] | None = None) -> Iterator[Served]:
    """A real `kvctl serve` whose first stdout line (its URL) has arrived; killed if still running after."""
    work = Path(tempfile.mkdtemp(dir=tmp))
    log = work / "stderr.log"
    cmd = [sys.executable, "-m", "kvctl", "serve", "--listen", listen, "--state-dir", str(work), *args]
    with log.open("w") as err, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}) as proc:
        try:
            ready, _, _ = select.select([proc.stdout], [], [], 30)
            url = proc.stdout.readline().strip() if ready else ""  # type: ignore[union-attr]
            assert url.startswith("http://"), (url, log.read_text())
            yield Served(proc, url, log)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _non_loopback_hostname() -> str | None:
    for name in sorted({socket.gethostname(), socket.getfqdn()}):
        try:
            infos = socket.getaddrinfo(name, None)
        except OSError:
            continue
        if infos and not any(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos):
            return name
    return None


@pytest.mark.parametrize("host", ["0.0.0.0", "[::]", "hostname"])
def test_non_loopback_listen_without_a_token_exits_2_binding_nothing(tmp_path: Path, host: str) -> None:
    if host == "hostname":
        host = _non_loopback_hostname() or ""
        if not host:
            pytest.skip("no hostname here resolves to a non-loopback address")
    port = free_port()
    code, out, err = refused("--listen", f"{host}:{port}", "--state-dir", str(tmp_path))
    assert code == 2 and out == "", (out, err)  # no URL: nothing was bound
    assert len(err.strip().splitlines()) == 1 and "--admin-token" in err and "--insecure" in err, err
    assert list(tmp_path.iterdir()) == []
    with socket.socket() as sock:  # and the port it named is free
        sock.bind(("127.0.0.1", port))


def test_non_loopback_listen_with_a_token_from_the_environment(tmp_path: Path) -> None:
    with serve(tmp_path, "0.0.0.0:0", env={"KVCTL_ADMIN_TOKEN": TOKEN}) as served, served.client() as client:
        assert served.url.startswith("http://0.0.0.0:")
        assert client.get("/healthz").status_code == 200
        assert client.post("/v1/reset", json={}).status_code == 401
        assert client.post("/v1/reset", json={}, headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200
        log = served.stop()
    assert "without an admin token" not in log and TOKEN not in log


def test_insecure_non_loopback_listen_starts_and_warns(tmp_path: Path) -> None:
    with serve(tmp_path, "0.0.0.0:0", "--insecure") as served, served.client() as client:
        assert client.post("/v1/reset", json={}).status_code == 200  # no token: open, as asked
        log = served.stop()
    warnings = [line for line in log.splitlines() if "WARNING" in line and "without an admin token" in line]
    assert len(warnings) == 1 and "--insecure" in warnings[0] and "0.0.0.0" in warnings[0], log


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "localhost:0", "[::1]:0"])
def test_loopback_listen_needs_no_token(tmp_path: Path, listen: str) -> None:
    with serve(tmp_path, listen) as served, served.client() as client:
        assert client.post("/v1/workers", json={"worker_id": 1}).status_code == 201
        log = served.stop()
    assert "without an admin token" not in log


# ----- 3. request bodies capped ---------------------------------------------------------------------------

def _chunks(total: int, size: int = 256) -> Iterator[bytes]:
    """A body with no Content-Length (httpx sends a generator chunked)."""
    sent = 0
    while sent < total:
        yield b" " * min(size, total - sent)
        sent += size


@on_both_route_paths
def test_bodies_over_the_cap_get_413_naming_it_and_the_router_keeps_serving(tmp_path: Path) -> None:
    auth = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    with serve(tmp_path, "127.0.0.1:0", "--max-body-bytes", "1000", "--admin-token", TOKEN) as served, \
            served.client() as client:
        for path in ["/v1/events", "/v1/workers", "/v1/reset", "/busy_threshold", "/v1/route"]:
            sized = client.post(path, content=b" " * 1001, headers=auth)
            chunked = client.post(path, content=_chunks(3000), headers=auth)
            assert "content-length" not in chunked.request.headers
            assert chunked.request.headers["transfer-encoding"] == "chunked"
            for answer in (sized, chunked):
                assert answer.status_code == 413, (path, answer.text)
                assert "1000-byte limit" in answer.json()["error"], answer.text
        assert client.get("/healthz").status_code == 200
        at_cap = json.dumps({"worker_id": 7}).encode().ljust(1000)
        assert client.post("/v1/workers", content=at_cap, headers=auth).status_code == 201
        chunked_small = client.post("/v1/workers", content=iter([b'{"worker_id":', b" 8}"]), headers=auth)
        assert chunked_small.status_code == 201, chunked_small.text  # under the cap, chunked: read whole, applied
        assert {w["worker_id"] for w in client.get("/v1/workers").json()["workers"]} == {7, 8}
        assert client.post("/v1/route", json={"token_ids": list(range(16))}).status_code == 200
        served.stop()


def test_max_body_bytes_must_be_positive() -> None:
    result = CliRunner().invoke(cli, ["serve", "--max-body-bytes", "0"])
    assert result.exit_code == 2 and "--max-body-bytes" in result.stderr


# ----- 4. no secret in logs, status, metrics or config show -----------------------------------------------

NATS_SECRET = "nats-" + secrets.token_hex(10)
WRONG_SECRET = "wrong-" + secrets.token_hex(10)
WRONG_TOKEN = "adm-wrong-" + secrets.token_hex(10)


def _nats_auth(mode: str, url: str, secret: str) -> list[str]:
    host = url.removeprefix("nats://")
    return {"password": ["--nats", url, "--nats-user", "alice", "--nats-password", secret],
            "token": ["--nats", url, "--nats-token", secret],
            "url-password": ["--nats", f"nats://alice:{secret}@{host}"],
            "url-token": ["--nats", f"nats://{secret}@{host}"]}[mode]


def _plane(client: httpx.Client) -> dict[str, Any]:
    return client.get("/v1/status").json()["event_plane"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(("log_format", "mode"), [("text", "password"), ("json", "token"),
                                                  ("json", "url-password"), ("text", "url-token")])
def test_no_secret_in_logs_status_or_metrics(tmp_path: Path, log_format: str, mode: str) -> None:
    conf = tmp_path / "nats.conf"
    conf.write_text(f"authorization {{ token: {NATS_SECRET} }}" if "token" in mode else
                    f'authorization {{ users = [ {{user: alice, password: "{NATS_SECRET}"}} ] }}')
    nats = NatsServer(tmp_path / "store", "-c", str(conf))
    common = ["--admin-token", TOKEN, "--log-level", "debug", "--log-format", log_format]
    seen: list[str] = []
    try:
        with ExitStack() as stack:
            good = stack.enter_context(serve(tmp_path, "127.0.0.1:0", *common,
                                             *_nats_auth(mode, nats.url, NATS_SECRET),
                                             env={"KVCTL_MAX_BODY_BYTES": "4096"}))
            bad = stack.enter_context(serve(tmp_path, "127.0.0.1:0", *common,
                                            *_nats_auth(mode, nats.url, WRONG_SECRET)))
            for served in (good, bad):
                client = stack.enter_context(served.client())
                for header in (None, f"Bearer {WRONG_TOKEN}", f"Bearer {TOKEN}"):
                    answer = client.post("/v1/workers", json={"worker_id": 1},
                                         headers={"authorization": header} if header else {})
                    assert answer.status_code == (201 if header and TOKEN in header.split()[-1:] else 401)
                    seen.append(answer.text)
                big = client.post("/v1/events", content=_chunks(5000), headers={"authorization": f"Bearer {TOKEN}"})
                seen.append(big.text)
                if served is good:
                    assert big.status_code == 413 and "4096-byte limit" in big.json()["error"]  # the env var's cap
                    plane = eventually(partial(_plane, client), "the plane ready", until=lambda p: p["ready"],
                                       timeout=15)
                    assert plane["state"] == "connected" and plane["ready"], plane
                else:
                    plane = eventually(partial(_plane, client), "the plane refused",
                                       until=lambda p: "Authorization Violation" in (p["last_error"] or ""),
                                       timeout=15)
                    assert plane["state"] == "connecting" and "Authorization Violation" in plane["last_error"], plane
                if "url" in mode:
                    assert "***@" in plane["url"], plane["url"]  # shown, with the secret masked
                seen += [json.dumps(client.get("/v1/status").json()), client.get("/metrics").text,
                         client.get("/v1/workers").text]
            logs = {"good": good.stop(), "bad": bad.stop()}
    finally:
        nats.stop()
    assert "event plane: following" in logs["good"] and "uvicorn" in logs["bad"]  # logs were written
    if log_format == "json":
        for log in logs.values():
            entries = [json.loads(line) for line in log.splitlines()[1:] if line.strip()]
            assert entries and all({"ts", "level", "msg"} <= set(e) for e in entries)
    everything = "\n".join([*seen, *logs.values()])
    for secret in (TOKEN, NATS_SECRET, WRONG_SECRET, WRONG_TOKEN):
        assert secret not in everything, secret


def test_serve_help_never_shows_secrets_from_the_environment() -> None:
    env = {"KVCTL_ADMIN_TOKEN": TOKEN, "KVCTL_NATS_PASSWORD": NATS_SECRET, "KVCTL_NATS_TOKEN": WRONG_SECRET}
    result = CliRunner().invoke(cli, ["serve", "--help"], env=env, terminal_width=200)
    assert result.exit_code == 0 and "KVCTL_ADMIN_TOKEN" in result.stdout
    assert TOKEN not in result.output and NATS_SECRET not in result.output and WRONG_SECRET not in result.output


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "config.toml"
    path.write_text('current-context = "prod"\n[contexts.prod]\n'
                    f'server = "http://admin:{NATS_SECRET}@router.prod:7433"\n'
                    f'token = "{TOKEN}"\nprometheus = "https://prom:{WRONG_SECRET}@prom.prod:9090/x"\n')
    return path


@pytest.mark.parametrize("output", [[], ["-o", "json"], ["-o", "yaml"], ["--sources"], ["--sources", "-o", "json"]])
def test_config_show_redacts_the_token_and_url_passwords(config: Path, output: list[str]) -> None:
    runner = CliRunner()
    shown = runner.invoke(cli, ["config", "show", *output], env={"KVCTL_CONFIG": str(config)})
    assert shown.exit_code == 0, shown.output
    for secret in (TOKEN, NATS_SECRET, WRONG_SECRET):
        assert secret not in shown.output
    assert "***" in shown.stdout and "router.prod:7433" in shown.stdout and "admin" in shown.stdout
    if "json" in output:
        settings = json.loads(shown.stdout)["settings"]
        assert settings["token"] == "***"
        assert settings["server"] == "http://admin:***@router.prod:7433"
        assert settings["prometheus"] == "https://prom:***@prom.prod:9090/x"
    revealed = runner.invoke(cli, ["config", "show", "--show-token", "-o", "json"], env={"KVCTL_CONFIG": str(config)})
    assert json.loads(revealed.stdout)["settings"]["token"] == TOKEN  # the redaction is a choice, not a loss
    from_env = runner.invoke(cli, ["config", "show", *output], env={"KVCTL_CONFIG": str(config),
                                                                    "KVCTL_TOKEN": WRONG_TOKEN})
    assert from_env.exit_code == 0 and WRONG_TOKEN not in from_env.output


def test_config_set_does_not_echo_secrets(config: Path) -> None:
    env = {"KVCTL_CONFIG": str(config)}
    for key, value in [("token", WRONG_TOKEN), ("server", f"http://ops:{WRONG_SECRET}@router:7433")]:
        result = CliRunner().invoke(cli, ["config", "set", key, value, "-o", "json"], env=env)
        assert result.exit_code == 0, result.output
        assert WRONG_TOKEN not in result.output and WRONG_SECRET not in result.output
    assert WRONG_TOKEN in config.read_text()  # written all the same


def test_nats_commands_never_print_credentials_written_into_the_url(tmp_path: Path) -> None:
    """`events publish`, `events tail` and `tree dump nats://` name the server they talk to: masked."""
    conf = tmp_path / "nats.conf"
    conf.write_text(f'authorization {{ users = [ {{user: alice, password: "{NATS_SECRET}"}} ] }}')
    nats = NatsServer(tmp_path / "store", "-c", str(conf))
    dump = tmp_path / "dump.jsonl"
    dump.write_text(json.dumps({"worker_id": 1, "event": {"event_id": 1, "data": {"stored": {
        "parent_hash": None, "blocks": [{"block_hash": 11, "tokens_hash": 22}]}}}}) + "\n")
    host = nats.url.removeprefix("nats://")
    secret_url = f"nats://alice:{NATS_SECRET}@{host}"
    unreachable = f"nats://alice:{NATS_SECRET}@127.0.0.1:{free_port()}"
    invoke = CliRunner().invoke
    publish = ["events", "publish", str(dump), "--nats"]
    try:
        results = {
            "tail": invoke(cli, ["events", "tail", "--nats", secret_url, "--duration", "0.3"]),
            "publish": invoke(cli, [*publish, secret_url, "--yes", "-o", "json"]),
            "unconfirmed": invoke(cli, [*publish, secret_url]),
            "dump": invoke(cli, ["tree", "dump", secret_url]),
            "unreachable": invoke(cli, [*publish, unreachable, "--yes"]),
            "unreachable dump": invoke(cli, ["tree", "dump", unreachable]),
        }
    finally:
        nats.stop()
    assert results["tail"].exit_code == 4 and f"alice:***@{host}" in results["tail"].stderr, results["tail"].output
    assert json.loads(results["publish"].stdout)["published"] == 1
    assert results["unconfirmed"].exit_code != 0 and "***@" in results["unconfirmed"].output
    assert results["dump"].exit_code == 1 and "no snapshot" in results["dump"].stderr, results["dump"].output
    assert results["unreachable"].exit_code == 3 and results["unreachable dump"].exit_code == 3
    for name, result in results.items():
        assert NATS_SECRET not in result.output, (name, result.output)


def test_secrets_on_the_command_line_are_blanked_from_ps(tmp_path: Path) -> None:
    """`ps` shows any local user /proc/PID/cmdline: the router's own, for as long as it runs."""
    nats_secret = "nats-" + secrets.token_hex(8)
    args = ["--admin-token", TOKEN, f"--nats-token={nats_secret}", "--nats", f"nats://alice:{WRONG_SECRET}@127.0.0.1:1"]
    with serve(tmp_path, "127.0.0.1:0", *args) as served, served.client() as client:
        cmdline = Path(f"/proc/{served.proc.pid}/cmdline").read_bytes().decode()
        for secret in (TOKEN, nats_secret, WRONG_SECRET):
            assert secret not in cmdline
        assert "\0--admin-token\0" + "*" * len(TOKEN) + "\0" in cmdline and "nats://*" in cmdline
        assert client.post("/v1/workers", json={"worker_id": 1},
                           headers={"authorization": f"Bearer {TOKEN}"}).status_code == 201  # still the token
        log = served.stop()
    assert "KVCTL_ADMIN_TOKEN" in log


def test_the_admin_token_can_come_from_a_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    with serve(tmp_path, "127.0.0.1:0", "--admin-token-file", str(token_file)) as served, served.client() as client:
        assert client.post("/v1/workers", json={"worker_id": 1}).status_code == 401
        assert client.post("/v1/workers", json={"worker_id": 1},
                           headers={"authorization": f"Bearer {TOKEN}"}).status_code == 201
        assert "KVCTL_ADMIN_TOKEN" not in served.stop()  # nothing secret on the command line: no warning
    (tmp_path / "empty").write_text("\n")
    for args, needle in ((["--admin-token", TOKEN, "--admin-token-file", str(token_file)], "give one"),
                         (["--admin-token-file", str(tmp_path / "none")], "cannot read"),
                         (["--admin-token-file", str(tmp_path / "empty")], "is empty")):
        code, _, err = refused(*args)
        assert code == 2 and needle in err and err.count("\n") == 1, err
