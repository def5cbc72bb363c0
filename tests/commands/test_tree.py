"""`kvctl tree` against real sources: `kvctl serve` processes, Dynamo's standalone indexer, a NATS snapshot.

Asserts exit codes and parsed `-o json`, never prose.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from kvctl.cli import app
from kvctl.core.events.plane import RADIX_STATE_OBJECT, PlaneNames
from tests.fixtures_path import FIXTURES
from tests.nats_server import NatsServer, free_port
from tests.server.test_serve_process import serving

DUMP_FILE = FIXTURES / "dynamo-1.6.1" / "dump.jsonl"
DUMP = DUMP_FILE.read_text()
JSONL = {"content-type": "application/x-ndjson"}
# One block more for worker 1, under the last block of its fixture chain (depth 4).
EXTRA = {"worker_id": 1, "event": {"event_id": 99, "data": {"stored": {
    "parent_hash": 10637160587299395042, "blocks": [{"block_hash": 42, "tokens_hash": 4242}]}}, "dp_rank": 0}}

runner = CliRunner()


def kvctl(*args: str, input: str | None = None) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args), input=input)
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def router(tmp_path: Path) -> Iterator[httpx.Client]:
    """A `kvctl serve` process loaded with Dynamo's dump fixture."""
    with serving(tmp_path, "--no-restore") as (_, client):
        assert client.post("/v1/events", content=DUMP, headers=JSONL).json()["applied"] == len(DUMP.splitlines())
        yield client


@pytest.fixture
def other_router(tmp_path: Path) -> Iterator[httpx.Client]:
    with serving(tmp_path / "other", "--no-restore") as (_, client):
        yield client


def test_two_routers_fed_the_same_stream_are_equal_until_one_gets_a_block(router: httpx.Client,
                                                                          other_router: httpx.Client) -> None:
    a, b = str(router.base_url), str(other_router.base_url)
    other_router.post("/v1/events", content=DUMP, headers=JSONL)
    code, out, _ = kvctl("tree", "diff", a, b, "-o", "json", "--exit-code")
    assert code == 0 and json.loads(out)["equal"] is True

    assert other_router.post("/v1/events", json=EXTRA).json()["applied"] == 1
    code, out, _ = kvctl("tree", "diff", a, b, "-o", "json", "--exit-code")
    diff = json.loads(out)
    assert code == 1 and diff["equal"] is False
    assert [(w["worker"], w["only_a"], w["only_b"]) for w in diff["workers"] if w["only_a"] or w["only_b"]] == [
        ("1:0", 0, 1)]
    assert diff["only_a"] == []
    assert [(x["worker_id"], x["dp_rank"], x["depth"], x["local_hash"]) for x in diff["only_b"]] == [(1, 0, 5, 4242)]
    assert kvctl("tree", "diff", a, b, "-o", "json")[0] == 0  # without --exit-code a difference is no failure


def test_a_kvctl_dump_equals_the_dynamo_dump_it_was_loaded_from(router: httpx.Client, tmp_path: Path) -> None:
    url = str(router.base_url)
    assert kvctl("tree", "diff", url, str(DUMP_FILE), "--exit-code", "-o", "json")[0] == 0
    code, out, _ = kvctl("-s", url, "tree", "dump", "-o", "json")  # the source defaults to --server
    assert code == 0 and len(json.loads(out)) >= 1
    saved = tmp_path / "kvctl-dump.json"
    saved.write_text(out)
    code, out, _ = kvctl("tree", "diff", str(saved), str(DUMP_FILE), "-o", "json", "--exit-code")
    assert code == 0 and json.loads(out)["equal"] is True


def test_stats_and_dump_formats_agree_with_the_router(router: httpx.Client) -> None:
    url = str(router.base_url)
    code, out, _ = kvctl("tree", "stats", url, "-o", "json")
    stats = json.loads(out)
    served = router.get("/v1/tree/stats").json()["models"]["default"]
    assert code == 0
    assert stats.pop("streams") == {}  # a router's own: what its engine streams showed (none: fed over HTTP)
    shared = ("blocks", "nodes", "workers", "tiers")
    assert {k: stats[k] for k in shared} == {k: served[k] for k in shared}
    code, out, _ = kvctl("tree", "dump", url, "--format", "stats", "-o", "json")
    assert code == 0 and json.loads(out) == stats
    code, out, _ = kvctl("tree", "dump", url, "--worker", "2", "-o", "json")
    assert code == 0 and {e["worker_id"] for e in json.loads(out)} == {2}
    code, out, _ = kvctl("tree", "dump", url, "--format", "events")  # JSONL for people
    assert code == 0 and all(json.loads(line)["event"] for line in out.splitlines())
    code, out, _ = kvctl("tree", "dump", url, "--depth", "1")
    assert code == 0 and out


def test_an_unknown_model_is_an_error(router: httpx.Client) -> None:
    code, _, err = kvctl("tree", "dump", str(router.base_url), "--model", "nope")
    assert code == 1 and len(err.splitlines()) == 1


@pytest.fixture
def dynamo_indexer() -> Iterator[str]:
    pytest.importorskip("dynamo")
    port = free_port()
    argv = [sys.executable, "-m", "dynamo.indexer", "--port", str(port), "--block-size", "16", "--threads", "1"]
    with subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    httpx.get(f"{url}/dump", timeout=1).raise_for_status()
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline and proc.poll() is None, "dynamo.indexer did not start"
                    time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            proc.wait(10)


def test_a_dynamo_indexer_source(dynamo_indexer: str, other_router: httpx.Client) -> None:
    source = "dynamo+" + dynamo_indexer
    code, out, _ = kvctl("tree", "diff", source, str(other_router.base_url), "-o", "json", "--exit-code")
    assert code == 0 and json.loads(out)["workers"] == []
    code, out, _ = kvctl("tree", "dump", source, "-o", "json")
    assert code == 0 and json.loads(out) == []
    assert kvctl("tree", "dump", source, "--model", "nope")[0] == 1


def test_dynamo_and_kvctl_fed_by_one_engine_hold_the_same_tree(dynamo_indexer: str,
                                                                other_router: httpx.Client) -> None:
    """One vLLM-format publisher, subscribed to by both: their dumps differ in shape, not in content."""
    import zmq

    from kvctl.core.events.engine_encode import VLLM, BlockStored, encode_batch

    with zmq.Context() as ctx, ctx.socket(zmq.XPUB) as pub:
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # hear the second subscription to the same topic too
        endpoint = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
        httpx.post(f"{dynamo_indexer}/register", json={"instance_id": 7, "endpoint": endpoint,
                                                       "model_name": "default", "block_size": 16}).raise_for_status()
        assert other_router.post("/v1/workers", json={"worker_id": 7, "endpoint": endpoint}).status_code == 201
        pub.setsockopt(zmq.RCVTIMEO, 10_000)
        assert [pub.recv()[:1] for _ in range(2)] == [b"\x01", b"\x01"]  # both subscribed: nothing is lost
        batches = [BlockStored([11, 12, 13], None, list(range(48)), 16),
                   BlockStored([14], 13, list(range(100, 116)), 16), BlockStored([21], None, list(range(1, 17)), 16)]
        for seq, event in enumerate(batches):
            pub.send_multipart([b"", seq.to_bytes(8, "big"), encode_batch(VLLM, time.time(), [event])])
        deadline = time.monotonic() + 10
        while True:
            code, out, _ = kvctl("tree", "diff", "dynamo+" + dynamo_indexer, str(other_router.base_url), "-o", "json")
            diff = json.loads(out)
            if diff["workers"] and diff["workers"][0]["blocks_a"] == diff["workers"][0]["blocks_b"] == 5:
                break
            assert time.monotonic() < deadline, diff
            time.sleep(0.2)
    assert code == 0 and diff["equal"] is True
    streamed = json.loads(kvctl("tree", "stats", "dynamo+" + dynamo_indexer, "--top", "3", "-o", "json")[1])
    replayed = json.loads(kvctl("tree", "dump", "dynamo+" + dynamo_indexer, "--format", "stats", "-o", "json")[1])
    assert streamed == replayed and streamed["paths"] == 5


def test_a_nats_snapshot_source(tmp_path: Path) -> None:
    import nats

    server = NatsServer(tmp_path / "nats")
    names = PlaneNames("treetest", "backend")

    async def upload() -> None:
        nc = await nats.connect(server.url)
        store = await nc.jetstream().create_object_store(names.bucket)
        await store.put(RADIX_STATE_OBJECT, DUMP.encode())
        await nc.close()

    try:
        source = ("tree", "diff", server.url, str(DUMP_FILE), "-o", "json", "--exit-code")
        assert kvctl(*source, "--namespace", names.namespace)[0] == 1  # no snapshot there yet: an error
        asyncio.run(upload())
        code, out, _ = kvctl(*source, "--namespace", names.namespace)
        assert code == 0 and json.loads(out)["equal"] is True
    finally:
        server.stop()


@pytest.mark.parametrize(("args", "code"), [
    (("tree", "dump", "http://127.0.0.1:1"), 3),
    (("tree", "diff", str(DUMP_FILE), "dynamo+http://127.0.0.1:1"), 3),
    (("tree", "dump", "ftp://example"), 2),
    (("tree", "dump", "/no/such/dump.jsonl"), 2),
    (("tree", "stats", str(FIXTURES / "dynamo-1.6.1" / "errors.json")), 2),
    (("tree", "dump", str(DUMP_FILE), "--worker", "x:y"), 2),
    (("tree", "dump", str(DUMP_FILE), "--format", "tree", "-o", "json"), 2),
    (("tree", "dump", str(DUMP_FILE), "--depth", "0"), 2),
    (("tree", "diff", "-", "-"), 2),
    (("tree", "diff", str(DUMP_FILE)), 2),
])
def test_failures_exit_with_their_code_and_one_line(args: tuple[str, ...], code: int) -> None:
    got, _, err = kvctl(*args)
    assert got == code and len(err.splitlines()) == 1
    if code == 3:
        assert "127.0.0.1:1" in err


@pytest.mark.parametrize("worker", ["2:", "+2", "-1", str(2**64), f"2:{2**32}"])
def test_a_worker_that_cannot_be_is_refused_naming_the_flag(worker: str) -> None:
    """As every --worker: `2:` no longer reads as worker 2, nor an id past u64 as a worker the dump lacks."""
    code, _, err = kvctl("tree", "dump", str(DUMP_FILE), "--worker", worker)
    assert code == 2 and len(err.splitlines()) == 1 and "--worker: " in err, err


def test_file_sources_in_every_output_format() -> None:
    code, out, _ = kvctl("tree", "stats", str(DUMP_FILE), "-o", "yaml")
    assert code == 0 and "shared_prefixes" in out
    code, out, _ = kvctl("tree", "stats", str(DUMP_FILE), "-o", "name")
    assert code == 0 and out.split() == ["1:0", "2:0", "2:1", "9223372036854775815:0"]
    code, out, _ = kvctl("tree", "diff", str(DUMP_FILE), "-", "-o", "name", input=DUMP)
    assert code == 0 and len(out.split()) == 4


def test_dump_o_name_prints_the_holders_whatever_the_format() -> None:
    for fmt in ("tree", "events", "stats"):
        code, out, _ = kvctl("tree", "dump", str(DUMP_FILE), "--format", fmt, "-o", "name")
        assert code == 0 and out.split() == ["1:0", "2:0", "2:1", "9223372036854775815:0"], (fmt, out)
    code, out, _ = kvctl("tree", "dump", str(DUMP_FILE), "--worker", "2", "-o", "name")
    assert code == 0 and out.split() == ["2:0", "2:1"]


def test_dump_o_wide_adds_each_node_s_sequence_hash() -> None:
    """The sequence hash of a node's last block: its path's, as `kvctl hash` and the diff's wide column name it."""
    _, narrow, _ = kvctl("tree", "dump", str(DUMP_FILE))
    code, wide, _ = kvctl("tree", "dump", str(DUMP_FILE), "-o", "wide")
    _, diff, _ = kvctl("tree", "diff", str(DUMP_FILE), "-", "-o", "json", input="")
    assert code == 0 and len(wide.splitlines()) == len(narrow.splitlines()) and wide != narrow
    deepest = {row["sequence_hash"] for row in json.loads(diff)["only_a"] if row["depth"] == 7}
    assert deepest and all(f"seq {h}" in wide for h in deepest)
    assert "seq " not in narrow


def test_stats_prints_only_sections_with_rows_and_the_totals_last() -> None:
    one_worker = "".join(line + "\n" for line in DUMP.splitlines() if line.startswith('{"worker_id":2,'))
    code, out, _ = kvctl("tree", "stats", "-", input=one_worker.replace('"dp_rank":1', '"dp_rank":0'))
    assert code == 0
    assert "shared prefixes" not in out  # one worker shares nothing: no title over an empty table
    assert [line for line in out.splitlines() if not line[:1].isspace() and not line[:1].isdigit()][-2:] == [
        "totals", "BLOCKS  NODES  DISTINCT  WORKERS"]
    code, out, _ = kvctl("tree", "stats", str(DUMP_FILE))
    assert code == 0 and out.index("shared prefixes") < out.index("totals")
