"""A `kvctl serve` process follows as many engines as its file limit allows and refuses the next one with 409,
against real PUB sockets: past ~1022 endpoints a router once answered 201 to every registration, then its
decode process died of `Too many open files` and 278 streams stopped. Here the limit is lowered instead."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import zmq

from kvctl.core.events.engine_encode import FORMATS, BlockStored, encode_batch
from tests.support import eventually


@contextmanager
def serve(state_dir: Path, *extra: str, nofile: int | None = None) -> Iterator[httpx.Client]:
    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    cmd = [sys.executable, "-m", "kvctl", "serve", "--listen", "127.0.0.1:0", "--state-dir", str(state_dir),
           "--log-level", "info", "--decoder", "process", *extra]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, preexec_fn=limit,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
        try:
            url = proc.stdout.readline().strip()  # type: ignore[union-attr]
            assert url.startswith("http://"), url
            with httpx.Client(base_url=url, timeout=10) as client:
                yield client
        finally:
            proc.kill()
            proc.wait()


@contextmanager
def engines(count: int) -> Iterator[list[tuple[zmq.Socket[bytes], str]]]:
    """`count` engine PUB sockets (XPUB: they see their subscriber arrive)."""
    ctx = zmq.Context()
    socks = []
    try:
        for _ in range(count):
            pub = ctx.socket(zmq.XPUB)
            pub.setsockopt(zmq.LINGER, 0)
            socks.append((pub, f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"))
        yield socks
    finally:
        for pub, _ in socks:
            pub.close(0)
        ctx.term()


def register(client: httpx.Client, worker_id: int, endpoint: str) -> httpx.Response:
    return client.post("/v1/workers", json={"worker_id": worker_id, "endpoint": endpoint})


def test_past_max_engines_a_registration_is_refused_with_409_and_counted(tmp_path: Path) -> None:
    with engines(5) as pubs, serve(tmp_path, "--max-engines", "3") as client:
        codes = [register(client, n, endpoint).status_code for n, (_, endpoint) in enumerate(pubs, 1)]
        assert codes == [201, 201, 201, 409, 409]
        refusal = register(client, 4, pubs[3][1]).json()
        assert "--max-engines" in refusal["error"] and "3 engine endpoints" in refusal["error"]
        assert register(client, 2, pubs[1][1]).status_code == 201  # already followed: takes no more room
        assert [w["worker_id"] for w in client.get("/v1/workers").json()["workers"]] == [1, 2, 3]
        assert client.delete("/v1/workers/1").status_code == 200
        assert register(client, 4, pubs[3][1]).status_code == 201  # room again
        assert client.get("/v1/status").json()["engines"] == {"running": 3, "max": 3, "refused": 3}
        assert "kvctl_engines_refused_total 3.0" in client.get("/metrics").text


def test_a_low_file_limit_refuses_engines_rather_than_losing_their_streams(tmp_path: Path) -> None:
    """At a file limit of 256, 160 engines were all accepted (201); the decode process died of `Too many open
    files`, 35 engines were never subscribed to, and the router could not answer /v1/status any more. Now the
    default --max-engines (32 at 256: 6 descriptors an engine) refuses the rest with 409, and every stream
    accepted delivers."""
    batch = encode_batch(FORMATS["vllm"], 0.0, [BlockStored([7], None, list(range(16)), 16)])
    with engines(160) as pubs, serve(tmp_path, nofile=256) as client:
        codes = [register(client, n, endpoint).status_code for n, (_, endpoint) in enumerate(pubs, 1)]
        accepted = codes.count(201)
        assert codes == [201] * accepted + [409] * (160 - accepted) and accepted == 32
        for pub, _ in pubs[:accepted]:
            assert pub.poll(10_000), "a stream never subscribed"
            pub.recv()
            pub.send_multipart([b"", (0).to_bytes(8, "big"), batch])
        streams = eventually(lambda: client.get("/v1/status").json()["streams"], "one event on every stream",
                             until=lambda rows: len(rows) == accepted and all(s["events"] == 1 for s in rows),
                             timeout=20, interval=0.1)
        assert all(s["state"] == "running" and not s["failures"] for s in streams)
