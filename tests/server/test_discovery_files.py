"""A file discovery store holding what no Dynamo process writes (issue 36), followed by a real `kvctl serve`:
symlinks (to /dev/zero, to a 300 MB file outside the store), 300 MB records, a FIFO, records whose address is a
wildcard or the router's own HTTP port, thousands of records at closed ports. Each is skipped and counted once in
the ledger, costs no memory, blocks nothing (SIGTERM included), and the good publisher beside them is followed."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvctl.core.events.discovery import ChannelKey
from tests.server.discovery_router import Publisher, channel_record, file_name, router, wait_for
from tests.server.test_zmq_plane import captured

HUGE = 300 << 20
PEAK_RSS_MB = 160
"""The router's peak RSS with the hostile entries present: about 50 MB at rest, so any of them read shows (the
two 300 MB records and the linked 300 MB file were all read, and kept, before)."""


def fresh(path: Path) -> None:
    """Touched an hour ahead, as if its owner refreshed it: alive for the whole test (a record is dead 10 s after
    its last touch), without a loop to keep touching it."""
    ahead = time.time() + 3600
    os.utime(path, (ahead, ahead), follow_symlinks=False)


def put(bucket: Path, key: str, value: bytes) -> Path:
    path = bucket / file_name(key)
    path.write_bytes(value)
    fresh(path)
    return path


def key_of(publisher_id: int) -> str:
    return ChannelKey("dynamo", "backend", "generate", "kv-events", publisher_id).key


@pytest.fixture
def bucket(tmp_path: Path) -> Path:
    path = tmp_path / "store" / "v1" / "event_channels"
    path.mkdir(parents=True)
    return path


@pytest.fixture
def publisher() -> Publisher:
    p = Publisher(1)
    yield p
    p.close()


def test_links_huge_records_and_bad_addresses_are_skipped_counted_and_cost_no_memory(
        tmp_path: Path, bucket: Path, publisher: Publisher) -> None:
    put(bucket, publisher.key, publisher.record)
    outside = tmp_path / "outside"
    outside.write_bytes(b"")
    os.truncate(outside, HUGE)  # sparse: 300 MB to read, none on disk
    fresh(outside)
    for n, target in ((2, outside), (3, Path("/dev/zero"))):
        (bucket / file_name(key_of(n))).symlink_to(target)
        fresh(bucket / file_name(key_of(n)))
    for n in (4, 5):
        os.truncate(put(bucket, key_of(n), b""), HUGE)
        fresh(bucket / file_name(key_of(n)))
    put(bucket, *channel_record(6, "tcp://*:5557"))  # a publisher's bind address, advertised
    put(bucket, *channel_record(7, "tcp://0.0.0.0:5557"))
    with router(tmp_path, f"file:{tmp_path / 'store'}") as r:
        put(bucket, *channel_record(8, f"tcp://127.0.0.1:{r.url.rsplit(':', 1)[1]}"))  # this router's HTTP port
        expected = {"symlink": 2, "too_large": 2, "wildcard_address": 2, "own_address": 1}
        wait_for(lambda: r.losses() == expected, "each hostile entry counted")
        wait_for(lambda: r.connected() == {publisher.address}, "the good publisher followed beside them")
        listings = r.plane()["discovery"]["listings"]
        wait_for(lambda: r.plane()["discovery"]["listings"] >= listings + 4, "four more listings with them present")
        assert r.losses() == expected  # once each, not once a listing
        assert r.peak_rss_mb() < PEAK_RSS_MB
        assert r.client.get("/readyz").status_code == 200  # a loss is no fault: what was skipped is not a source
        code, findings = r.doctor()  # not OK (nor is it with no worker yet: the finding is what matters here)
        assert code != 0 and findings["lost:discovery"]["severity"] == "WARNING", findings
        assert "/dev/zero" in str(r.status()["health"]["losses"])  # the detail says where the link leads
        assert r.stop() < 15
    assert "Invalid HTTP request" not in r.log.read_text()  # never connected to its own HTTP port


def test_a_fifo_neither_freezes_discovery_nor_holds_sigterm(tmp_path: Path, bucket: Path,
                                                            publisher: Publisher) -> None:
    fifo = bucket / file_name(key_of(2))
    os.mkfifo(fifo)
    fresh(fifo)
    put(bucket, publisher.key, publisher.record)
    with router(tmp_path, f"file:{tmp_path / 'store'}") as r:
        wait_for(lambda: r.connected() == {publisher.address}, "the publisher beside the FIFO followed")
        assert r.losses() == {"not_a_file": 1}
        assert "is a FIFO" in str(r.status()["health"]["losses"])
        assert r.stop() < 15  # no thread left blocked in open(): the exit does not wait on it


@pytest.mark.parametrize(("records", "files"), [
    (200, 256),
    pytest.param(7000, 1024, marks=pytest.mark.slow),
])
def test_thousands_of_stale_records_are_capped_and_the_plane_goes_on(
        tmp_path: Path, bucket: Path, publisher: Publisher, records: int, files: int) -> None:
    """Records at a closed port cost four descriptors each while their sockets retry: past the file limit the plane
    once died (readyz 200, doctor OK). Now past --max-channels (by default what the limit allows) they are skipped
    and counted, the index is marked partial, and the publisher followed before them stays followed."""
    put(bucket, publisher.key, publisher.record)
    with router(tmp_path, f"file:{tmp_path / 'store'}", files=files) as r:
        wait_for(lambda: r.connected() == {publisher.address}, "the publisher followed")
        for n in range(records):
            put(bucket, *channel_record(100 + n, "tcp://127.0.0.1:9"))  # nothing listens on port 9
        wait_for(lambda: r.losses().get("too_many_channels"), "channels past the cap", timeout=60)
        cap = r.plane()["discovery"]["max_channels"]
        wait_for(lambda: r.losses()["too_many_channels"] == records + 1 - cap, "every channel past the cap counted")
        # the cap is counted before the listing's sockets are made, a slice at a time: wait for them
        wait_for(lambda: len(r.plane()["connections"]) == cap, "the channels under the cap followed")
        assert publisher.address in r.connected()
        frames = next(f for (topic, _), f in captured().items() if topic == "kv-events")[0]
        publisher.socket.send_multipart(frames)
        wait_for(lambda: any(c["messages"] for c in r.plane()["connections"]), "its messages still received")
        plane = r.plane()
        assert plane["state"] == "connected" and plane["last_error"] is None, plane["last_error"]
        fault = r.faults()["plane.channels"]
        assert not fault["blocks_ready"] and f"the {cap} followed (--max-channels)" in fault["reason"]
        ready = r.client.get("/readyz")
        assert (ready.status_code, ready.json()["status"]) == (200, "partial")
        code, findings = r.doctor()
        assert code != 0 and findings["part:plane.channels"]["severity"] == "WARNING", findings
        assert r.stop() < 15
