"""`kvctl serve`'s limits on clients, as a real process: idle and half-sent connections are closed, open
connections are capped, a client that stops reading is dropped, and no client holds up the exit."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.test_serve_process import _stop, serving
from tests.support import eventually
from tests.support.served import on_both_route_paths

WAIT_S = 15.0
"""A real process on a loaded machine: wider than `eventually`'s default."""
HALF_SENT = {
    "idle": b"",
    "partial head": b"GET /healthz HTTP/1.1\r\nhost: x",
    "partial body (app)": b"POST /v1/events HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n[",
    "partial body (route)": b"POST /v1/route HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{",
}


def _open(client: httpx.Client) -> int:
    return client.get("/v1/status").json()["connections"]["open"]  # type: ignore[no-any-return]


def _address(client: httpx.Client) -> tuple[str, int]:
    return client.base_url.host, client.base_url.port  # type: ignore[return-value]


@contextmanager
def _connected(client: httpx.Client, first_bytes: bytes, rcvbuf: int | None = None) -> Iterator[socket.socket]:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    with sock:
        sock.connect(_address(client))
        sock.sendall(first_bytes)
        yield sock


def _closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(0.01)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def _metric(client: httpx.Client, name: str) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.slow
@on_both_route_paths  # a half-sent route body on either path
def test_idle_and_half_sent_connections_are_closed_after_the_idle_timeout(tmp_path: Path) -> None:
    with serving(tmp_path, "--idle-timeout", "1") as (_, client), ExitStack() as stack:
        socks = {name: stack.enter_context(_connected(client, data)) for name, data in HALF_SENT.items()}
        started = time.monotonic()
        for name, sock in socks.items():
            eventually(lambda sock=sock: _closed_by_server(sock), f"the server to close the {name} connection",
                       timeout=WAIT_S)
        assert time.monotonic() - started < 5
        # The client's own keep-alive connection, idle since `serving` asked /readyz before these were opened,
        # was closed too; the request below opens a new one.
        timed_out = len(HALF_SENT) + 1
        assert _metric(client, "kvctl_http_connections_timed_out_total") == timed_out
        assert client.get("/v1/status").json()["connections"]["timed_out"] == timed_out


def test_connections_past_the_cap_get_503_and_are_closed(tmp_path: Path) -> None:
    with serving(tmp_path, "--max-connections", "3") as (_, client), ExitStack() as stack:
        assert client.get("/healthz").status_code == 200  # the client's own keep-alive connection: 1
        for _ in range(2):
            stack.enter_context(_connected(client, b""))
        eventually(lambda: _open(client), "3 connections open", until=lambda n: n == 3, timeout=WAIT_S)
        with _connected(client, b"") as extra:  # sent no request: the answer is not lost to a reset
            extra.settimeout(5)
            answer = b"".join(iter(lambda: extra.recv(65536), b""))  # read until the server closes it
        assert answer.startswith(b"HTTP/1.1 503 ") and b"--max-connections" in answer
        assert client.get("/v1/status").json()["connections"]["refused"] == 1
        assert _metric(client, "kvctl_http_connections_refused_total") == 1
        stack.close()  # room again
        eventually(lambda: _open(client), "the others to close", until=lambda n: n == 1, timeout=WAIT_S)
        with httpx.Client(base_url=client.base_url) as other:
            assert other.get("/healthz").status_code == 200


def test_a_uvicorn_without_the_fast_path_internals_serves_with_the_limits_its_own_way(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A uvicorn whose protocol moved (simulated before kvctl starts): one log line, routes answered by the app,
    --max-connections kept by uvicorn's own concurrency limit (its 503, not ours), and --max-head-bytes by its
    h11 protocol's (a 400)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import kvctl.server.http.route_protocol as r\nr.HttpToolsProtocol = None\n")
    # PYTHONPATH kept after it: sitecustomize imports kvctl before `-m` puts the cwd on sys.path.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(site), os.environ.get("PYTHONPATH")))))
    with serving(tmp_path / "state", "--max-connections", "2") as (proc, client):
        client.post("/v1/workers", json={"worker_id": 1})
        assert client.post("/v1/route", json={"token_ids": list(range(64))}).json()["worker_id"] == 1
        with httpx.Client(base_url=client.base_url) as second, httpx.Client(base_url=client.base_url) as third:
            assert second.get("/healthz").status_code == 200  # 2 open, the client's own keep-alive one included
            assert third.get("/healthz").status_code == 503
        with _connected(client, b"GET /healthz HTTP/1.1\r\n" + b"x-pad: %s\r\n" % (b"a" * 1000) * 70) as endless:
            endless.settimeout(WAIT_S)
            assert b"".join(iter(lambda: endless.recv(65536), b"")).startswith(b"HTTP/1.1 400 ")
        log = _stop(proc)
    assert log.count("lacks uvicorn.protocols.http.httptools_impl.HttpToolsProtocol: serving with its h11") == 1


def _big_index(client: httpx.Client, blocks: int = 200_000) -> None:
    stored = ",".join(f'{{"block_hash":{n},"tokens_hash":{n}}}' for n in range(1, blocks + 1))
    event = f'{{"worker_id":1,"event":{{"event_id":1,"data":{{"stored":{{"parent_hash":null,"blocks":[{stored}]}}}}}}}}'
    assert client.post("/v1/workers", json={"worker_id": 1}).status_code == 201
    assert client.post("/v1/events", content=event, timeout=60).json()["applied"] == 1


def test_a_client_that_stops_reading_its_answer_is_dropped(tmp_path: Path) -> None:
    with serving(tmp_path, "--idle-timeout", "1") as (_, client):
        _big_index(client)
        with _connected(client, b"GET /v1/tree HTTP/1.1\r\nhost: x\r\n\r\n", rcvbuf=4096) as reader:
            eventually(lambda: _metric(client, "kvctl_http_connections_timed_out_total") == 1,
                       "the stalled reader to be dropped", timeout=WAIT_S)
            assert _closed_by_server(reader)
        assert client.get("/healthz").status_code == 200


@pytest.mark.slow
def test_a_stalled_client_delays_the_exit_by_the_shutdown_timeout_at_most(tmp_path: Path) -> None:
    with (serving(tmp_path, "--shutdown-timeout", "1") as (proc, client),
          _connected(client, HALF_SENT["partial body (app)"])):
        eventually(lambda: _open(client), "the stalled client", until=lambda n: n == 2, timeout=WAIT_S)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - started < 5
    assert any(tmp_path.glob("state.log.*"))


@pytest.mark.slow
def test_a_second_sigterm_forces_the_exit_and_the_state_log_is_still_written(tmp_path: Path) -> None:
    with serving(tmp_path, "--shutdown-timeout", "60") as (proc, client):
        with _connected(client, HALF_SENT["partial body (app)"]):
            eventually(lambda: _open(client), "the stalled client", until=lambda n: n == 2, timeout=WAIT_S)
            client.close()
            proc.send_signal(signal.SIGTERM)

            def refused() -> bool:  # the listener closed: the graceful stop has begun
                try:
                    socket.create_connection(_address(client), timeout=1).close()
                except ConnectionRefusedError:
                    return True
                return False

            eventually(refused, "the router to stop listening", timeout=WAIT_S)
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 1
            assert time.monotonic() - started < 5
        assert "a second SIGTERM forced the exit" in proc.stderr.read()  # type: ignore[union-attr]
    assert any(tmp_path.glob("state.log.*"))


@on_both_route_paths
def test_reservations_past_the_cap_get_429_on_either_route_path(tmp_path: Path) -> None:
    with serving(tmp_path, "--max-reservations", "1") as (_, client):
        assert client.post("/v1/workers", json={"worker_id": 1}).status_code == 201
        answers = [client.post("/v1/route", json={"token_ids": list(range(64)), "reserve": True, "request_id": rid})
                   for rid in ("a", "b")]
        assert [a.status_code for a in answers] == [200, 429]
        assert answers[1].json()["flag"] == "--max-reservations"
