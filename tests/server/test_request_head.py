"""A request's head is bounded in bytes and in time on both route paths (issue 36): a client that streams header
lines without the blank line, or sends its head a byte at a time, gets 431 or 408 and its connection closed, and
each refusal is counted in the health ledger. Before, such a head grew the router by 250 MB a second until the
30-s idle timeout, on 4,096 connections at once.

Real sockets against the app served as `kvctl serve` serves it, in the test's loop (fast), and a real `kvctl
serve` process for the flags and the memory bound."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

from kvctl.core.doctor.checks import diagnose
from kvctl.core.doctor.findings import Severity
from kvctl.server.http.api import create_app
from kvctl.server.http.route_protocol import MAX_HEAD_BYTES, MAX_HEADERS, Connections
from kvctl.server.state import Fleet
from kvctl.server.worker_info import WorkerInfo
from tests.server.test_serve_process import serving
from tests.support.served import on_both_route_paths, served

WAIT_S = 30.0
"""How long a test waits for the router to close a connection: far past any deadline the tests set."""
ROUTE = json.dumps({"token_ids": list(range(64))}).encode()
PAD = b"x-pad-%03d: " + b"a" * 1000 + b"\r\n"
"""A header line of about 1 KiB: a head of them reaches the byte limit before the line limit."""


def _head(pad_lines: int, *, ended: bool, close: bool = False) -> bytes:
    head = b"POST /v1/route HTTP/1.1\r\nhost: router\r\ncontent-length: %d\r\n" % len(ROUTE)
    head += b"connection: close\r\n" if close else b""
    head += b"".join(PAD % n for n in range(pad_lines))
    return head + b"\r\n" + ROUTE if ended else head


def _app(connections: Connections) -> tuple[Fleet, object]:
    fleet = Fleet()
    fleet.register(WorkerInfo(1, 0, "default"))
    return fleet, create_app(fleet, connections=connections)


async def _answer(client: httpx.AsyncClient, sent: bytes) -> bytes:
    """What the router writes on a connection that sent `sent` and nothing more, until it closes it."""
    reader, writer = await asyncio.open_connection(client.base_url.host, client.base_url.port)
    try:
        writer.write(sent)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), WAIT_S)  # until EOF: the router closed it
    finally:
        writer.close()


def _lost(fleet: Fleet, cause: str) -> int:
    loss = fleet.health.losses.get(("http", cause))
    return loss.count if loss is not None else 0


async def test_a_head_past_the_byte_or_line_limit_gets_431_and_is_closed(route_path: str) -> None:
    fleet, app = _app(Connections())
    async with served(app, route_path) as client:
        lines = MAX_HEAD_BYTES // len(PAD % 0) + 1
        assert lines < MAX_HEADERS  # the bytes, not the lines, are what this head is over
        # A head that never ends, its bytes past the limit: refused once they are in.
        answer = await _answer(client, _head(lines, ended=False))
        assert answer.startswith(b"HTTP/1.1 431 ") and b"connection: close\r\n" in answer, answer[:200]
        assert b"--max-head-bytes" in answer
        # A whole head over the limit, in one write with its body: refused as well, its request not answered.
        answer = await _answer(client, _head(lines, ended=True) + _head(0, ended=True))
        assert answer.startswith(b"HTTP/1.1 431 ") and answer.count(b"HTTP/1.1") == 1
        # Past the line limit in short lines, long before the byte limit.
        answer = await _answer(client, b"GET /healthz HTTP/1.1\r\n" + b"a: b\r\n" * 2 * MAX_HEADERS)
        assert answer.startswith(b"HTTP/1.1 431 ")
        assert _lost(fleet, "head_too_large") == 3
        # A head just under the limit is a request like any other, on either path.
        answer = await _answer(client, _head(lines - 3, ended=True, close=True))
        assert answer.startswith(b"HTTP/1.1 200 ") and b'"worker_id":1' in answer, answer[:200]
        assert _lost(fleet, "head_too_large") == 3
        # The ledger shows it: /metrics, /v1/status and doctor.
        metrics = (await client.get("/metrics")).text
        assert 'kvctl_input_lost_total{cause="head_too_large",surface="http"} 3.0' in metrics
        status = (await client.get("/v1/status")).json()
        assert status["connections"]["max_head_bytes"] == MAX_HEAD_BYTES
        [finding] = [f for f in diagnose(status, [], []) if f.check == "lost:http"]
        assert finding.severity is Severity.WARNING and "head_too_large" in finding.cause
        assert "127.0.0.1:" in finding.cause and "--max-head-bytes" in finding.next_step


async def test_a_head_not_ended_by_the_head_deadline_gets_408_and_is_closed(route_path: str) -> None:
    """The deadline is the head's own, not the idle timeout (set far past the wait here)."""
    fleet, app = _app(Connections(idle_timeout_s=600, head_timeout_s=0.2))
    async with served(app, route_path) as client:
        answer = await _answer(client, _head(1, ended=False))
        assert answer.startswith(b"HTTP/1.1 408 ") and b"--head-timeout" in answer, answer[:200]
        assert _lost(fleet, "head_timeout") == 1 and _lost(fleet, "head_too_large") == 0
        assert (await client.post("/v1/route", content=ROUTE)).json()["worker_id"] == 1  # others are served


@contextmanager
def _streaming_heads(address: tuple[str, int], connections: int, limit: int) -> Iterator[list[int]]:
    """`connections` clients each sending header lines of a head that never ends, until the router closes
    their connection or `limit` bytes are sent; yields (once all have stopped) the bytes each sent."""
    sent = [0] * connections
    socks = [socket.create_connection(address) for _ in range(connections)]

    def stream(i: int) -> None:
        chunk = b"a: b\r\n" * 10_000  # short lines: the most Python objects a byte of head makes
        try:
            socks[i].sendall(b"GET /healthz HTTP/1.1\r\n")
            while sent[i] < limit:
                socks[i].sendall(chunk)
                sent[i] += len(chunk)
        except OSError:  # closed by the router: what the bound does
            pass

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(connections)]
    with ExitStack() as stack:
        for sock in socks:
            stack.enter_context(sock)
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        yield sent


def _memory_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


@on_both_route_paths
def test_heads_that_never_end_leave_the_routers_memory_bounded(tmp_path: Path) -> None:
    """Four clients stream header lines; the router's peak RSS (VmHWM) while they do stays within 32 MiB of what
    it was before (it grows by some 5 MiB). Before the bound, it held every line each had sent, 20 times its bytes
    in Python objects: 1.2 GB for these 64 MiB."""
    with serving(tmp_path) as (proc, client):
        before = max(_memory_kib(proc.pid, "VmHWM"), _memory_kib(proc.pid, "VmRSS"))
        with _streaming_heads((client.base_url.host, client.base_url.port), 4, 16 << 20) as sent:
            peak = _memory_kib(proc.pid, "VmHWM")
        assert peak - before < 32 * 1024, f"the router grew by {(peak - before) // 1024} MiB"
        assert all(n < 16 << 20 for n in sent), sent  # each was cut off before its 16 MiB
        losses = client.get("/v1/status").json()["health"]["losses"]
        assert [(x["surface"], x["cause"], x["count"]) for x in losses] == [("http", "head_too_large", 4)]


def test_serve_takes_the_head_limits_as_flags(tmp_path: Path) -> None:
    with serving(tmp_path, "--max-head-bytes", "2048", "--head-timeout", "0.2", "--idle-timeout", "600") as (
            _, client):
        address = (client.base_url.host, client.base_url.port)
        with socket.create_connection(address, timeout=WAIT_S) as big:
            big.sendall(_head(3, ended=False))  # 3 KiB, and no end
            assert b"".join(iter(lambda: big.recv(65536), b"")).startswith(b"HTTP/1.1 431 ")
        with socket.create_connection(address, timeout=WAIT_S) as slow:
            slow.sendall(b"GET /healthz HTTP/1.1\r\n")
            assert b"".join(iter(lambda: slow.recv(65536), b"")).startswith(b"HTTP/1.1 408 ")
        status = client.get("/v1/status").json()
        assert (status["connections"]["max_head_bytes"], status["connections"]["head_timeout_s"]) == (2048, 0.2)
        assert sorted((x["cause"], x["count"]) for x in status["health"]["losses"]) == [
            ("head_timeout", 1), ("head_too_large", 1)]
