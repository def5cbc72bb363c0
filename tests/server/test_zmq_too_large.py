"""A ZMQ frame over `--max-zmq-message-bytes` (issue 36), against real sockets: ten 256 MiB frames on an engine's PUB
took a router to a 1.98 GB peak. Now libzmq refuses each before taking it in and drops the connection, which the
router sees on the socket's monitor (a disconnect that libzmq never retries), counts in the health ledger, and
makes again: the engine's next batches arrive as before."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq
import zmq.asyncio

from kvctl.core.events.engine_encode import FORMATS, BlockStored, encode_batch
from kvctl.event_taps import TapStats, tap_zmq
from kvctl.server.ingest.decode_process.parent import make_decoder
from kvctl.server.ingest.streams import Streams
from kvctl.server.serve_choices import DecoderMode
from kvctl.server.state import Fleet
from kvctl.server.worker_info import WorkerInfo
from kvctl.zmq_limits import Drops
from tests.server.zmq_engine import Engine
from tests.support import eventually, eventually_async

LIMIT = 64 * 1024
BATCH = encode_batch(FORMATS["vllm"], 0.0, [BlockStored([7], None, list(range(16)), 16)])


def too_large(fleet: Fleet) -> int:
    loss = fleet.health.losses.get(("zmq", "too_large"))
    return 0 if loss is None else loss.count


@pytest.mark.parametrize("decoder", [DecoderMode.inline, DecoderMode.process])
async def test_an_oversized_frame_is_counted_and_the_stream_carries_on(decoder: DecoderMode) -> None:
    ctx = zmq.asyncio.Context()
    engine = Engine(ctx)
    fleet = Fleet()
    streams = Streams(fleet, decoder=make_decoder(decoder), max_message_bytes=LIMIT)
    try:
        streams.start(WorkerInfo(1, 0, "default", endpoint=engine.endpoint))
        await engine.subscribed()
        await engine.publish(0, b"\x91" + b"x" * (4 * LIMIT))  # refused before it is taken in: never decoded
        await engine.subscribed(timeout=10)  # subscribed again: the router made the connection again
        # Counted at once inline; the decoder process tells the router after it connects again, so wait for it.
        await eventually_async(lambda: too_large(fleet), "the refusal counted", until=lambda n: n == 1)
        await engine.publish(1, BATCH)
        (row,) = await eventually_async(streams.status, "the next batch applied", until=lambda r: r[0]["events"] == 1)
        assert row["state"] == "running" and row["decode_errors"] == {}
        loss = fleet.health.losses[("zmq", "too_large")]
        assert engine.endpoint in loss.detail and "--max-zmq-message-bytes" in loss.fix
    finally:
        await streams.close()
        await engine.close()
        ctx.term()


def test_a_peer_leaving_is_no_drop_and_a_disconnect_never_retried_is() -> None:
    drops: Drops[str] = Drops(wait_s=1.0)
    drops.seen(zmq.EVENT_DISCONNECTED, "tcp://a:1", 10.0)
    drops.seen(zmq.EVENT_CONNECT_RETRIED, "tcp://a:1", 10.0)  # libzmq connects again by itself
    drops.seen(zmq.EVENT_DISCONNECTED, "tcp://b:1", 10.0)
    assert drops.timeout(10.5) == 0.5
    assert drops.due(10.9) == []
    assert drops.due(11.0) == ["tcp://b:1"] and drops.due(12.0) == [] and drops.timeout(12.0) is None


def subscribed(pub: zmq.Socket[bytes]) -> None:
    """Until a subscription reaches the XPUB (an unsubscription of the dropped connection may come first)."""
    while True:
        assert pub.poll(20_000), "never subscribed (again)"
        if pub.recv()[:1] == b"\x01":
            return


def test_a_tap_counts_an_oversized_frame_and_keeps_listening() -> None:
    """`events tail --zmq`: a limit as the router's, the frame counted as `too_large`, the tap listening on."""
    import threading

    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
    stats, done, got = TapStats(), threading.Event(), []

    def tap() -> None:
        got.extend(t for t in tap_zmq(endpoint, stop=done.is_set, stats=stats, block_size=16, max_bytes=LIMIT)
                   if t.event is not None)

    thread = threading.Thread(target=tap)
    thread.start()
    try:
        subscribed(pub)
        pub.send_multipart([b"", (0).to_bytes(8, "big"), b"x" * (4 * LIMIT)])
        subscribed(pub)
        pub.send_multipart([b"", (1).to_bytes(8, "big"), BATCH])
        eventually(lambda: stats.events, "the next batch tapped", timeout=10)
        assert stats.decode_errors == {"too_large": 1}
    finally:
        done.set()
        thread.join(10)
        pub.close(0)
        ctx.term()


# ----- a router process against ten 256 MiB frames -----------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    """VmRSS of the router and its decode process."""
    total = 0
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for p in [pid, *map(int, children)]:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


@pytest.fixture
def router(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], httpx.Client]]:
    cmd = [sys.executable, "-m", "kvctl", "serve", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path),
           "--decoder", "process"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
        try:
            url = proc.stdout.readline().strip()  # type: ignore[union-attr]
            with httpx.Client(base_url=url, timeout=10) as client:
                eventually(lambda: client.get("/readyz").status_code == 200, "the router ready", timeout=30)
                yield proc, client
        finally:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_ten_256_mib_frames_leave_the_router_small_and_its_stream_running(
        router: tuple[subprocess.Popen[str], httpx.Client]) -> None:
    import threading

    proc, client = router
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
    huge = b"x" * (256 << 20)
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            peak[0] = max(peak[0], rss_bytes(proc.pid))

    sampler = threading.Thread(target=sample)
    try:
        assert client.post("/v1/workers", json={"worker_id": 1, "endpoint": endpoint}).status_code == 201
        subscribed(pub)
        base = rss_bytes(proc.pid)
        sampler.start()
        for seq in range(10):
            pub.send_multipart([b"", seq.to_bytes(8, "big"), huge])
            subscribed(pub)  # the router connected again
        pub.send_multipart([b"", (10).to_bytes(8, "big"), BATCH])
        row = eventually(lambda: client.get("/v1/status").json()["streams"][0], "the batch after them applied",
                         until=lambda r: r["events"] == 1, timeout=20)
        done.set()
        sampler.join()
        assert row["state"] == "running"
        losses = {(x["surface"], x["cause"]): x["count"] for x in client.get("/v1/status").json()["health"]["losses"]}
        assert losses[("zmq", "too_large")] == 10
        assert peak[0] - base < 64 << 20, f"the router grew by {(peak[0] - base) >> 20} MiB"  # main: a 1.98 GB peak
        assert 'kvctl_input_lost_total{cause="too_large",surface="zmq"} 10.0' in client.get("/metrics").text
    finally:
        done.set()
        pub.close(0)
        ctx.term()
