"""`kvctl tree stats` without reading a whole dump: a router computes them itself, in slices of its loop; a dump
file is read as a stream in memory bounded by the tree's width. Each way must give what replaying the whole
dump gives (`tree dump --format stats`, the old way) for the same index."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from kvctl.core.events import Removed, RouterEvent, Stored, Tier
from kvctl.core.events.dump_file import iter_dump_events
from kvctl.core.events.dynamo import encode_router_event_json
from kvctl.core.index import KvIndex
from kvctl.core.tree_diff import tree_stats
from kvctl.core.tree_stats import DumpStats, NotStreamable
from kvctl.runtime import survivors_frozen
from kvctl.server.budget import SLICE_S
from kvctl.server.http import tree_stats as tree_stats_http
from kvctl.server.http.tree_stats import index_shape
from tests.commands.live_router import json_of, kvctl, url_of
from tests.server.test_serve_process import serving

WORKERS, PROMPTS, PROMPT_BLOCKS = 6, 5, 12


def fleet_events(seed: int = 5, requests: int = 60) -> list[RouterEvent]:
    """Workers storing shared prompts and their own tails, as engines do; then some tails evicted from their
    end, so some edges are held whole by a few workers and only in part by others."""
    rng = random.Random(seed)
    prompts = [[rng.getrandbits(63) for _ in range(PROMPT_BLOCKS)] for _ in range(PROMPTS)]
    events, held = [], set()
    for n in range(requests):
        worker, p = n % WORKERS, rng.randrange(PROMPTS)
        tail = [rng.getrandbits(63) for _ in range(rng.randrange(1, 9))]
        locals_ = prompts[p][:rng.randrange(4, PROMPT_BLOCKS + 1)] + tail if (worker, p) not in held else tail
        parent = None if (worker, p) not in held else -1 - p  # a prompt's last block hash: see below
        hashes = [rng.getrandbits(63) for _ in locals_]
        if parent is None:
            hashes[:len(locals_) - len(tail)] = [10**6 * (p + 1) + i for i in range(len(locals_) - len(tail))]
            held.add((worker, p))
        else:  # under the prompt's blocks this worker stored whole
            locals_, hashes, parent = tail, hashes, None
        events.append(RouterEvent(worker, Stored(parent, hashes, locals_), 0, n))
        if n % 7 == 3:  # evict the last two blocks of this store
            events.append(RouterEvent(worker, Removed(hashes[-2:]), 0, 10_000 + n))
    return events


def dump_lines(events: list[RouterEvent]) -> str:
    return "".join(encode_router_event_json(e).decode() + "\n" for e in events)


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    with serving(tmp_path_factory.mktemp("router"), "--no-restore") as (_, client):
        answer = client.post("/v1/events", content=dump_lines(fleet_events()),
                             headers={"content-type": "application/x-ndjson"}).json()
        assert answer["applied"] > 50, answer
        yield client


def test_the_router_computes_the_stats_the_dump_gives(router: httpx.Client, tmp_path: Path) -> None:
    replayed = json_of(kvctl(router, "tree", "dump", "--format", "stats", "-o", "json"))  # the dump, replayed
    assert replayed["shared_prefixes"] and replayed["depths"] and replayed["paths"] > replayed["blocks"] / WORKERS
    for top in ("10", "2", "0"):
        by_router = json_of(kvctl(router, "tree", "stats", "--top", top, "-o", "json"))
        assert by_router.pop("streams") == {}  # what its engine streams showed, which no dump holds
        assert by_router == {**replayed, "shared_prefixes": replayed["shared_prefixes"][:int(top)]}
    answer = router.get("/v1/tree/stats", params={"shape": "true"}).json()["models"]["default"]
    assert answer["paths"] == replayed["paths"]  # the router answered it, and did not send a dump


def test_stats_a_router_computes_load_no_index_into_the_client(router: httpx.Client) -> None:
    """The command's start imports neither the index nor the replay of a dump (`tree_diff`): a router answers
    with the figures, and those imports were a tenth of the command's time on a busy 2-core machine."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvctl", "--server", url_of(router), "tree",
                           "stats", "-o", "json"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and json.loads(done.stdout)["paths"], done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time")}
    assert "kvctl.client.sources" in imported and not {"kvctl.core.tree_diff", "kvctl.core.index"} & imported


@pytest.mark.parametrize("shape", ["jsonl", "json"])
def test_a_dump_file_streams_to_the_stats_its_replay_gives(router: httpx.Client, tmp_path: Path,
                                                           shape: str) -> None:
    dump = router.get("/v1/tree", params={"format": shape}).text
    path = tmp_path / f"dump.{shape}"
    path.write_text(dump)
    replayed = json_of(kvctl(router, "tree", "dump", str(path), "--format", "stats", "-o", "json"))
    assert json_of(kvctl(router, "tree", "stats", str(path), "-o", "json")) == replayed
    streamed = DumpStats()
    streamed.add_all(iter_dump_events([dump[i:i + 100] for i in range(0, len(dump), 100)]))  # it streamed
    assert {**streamed.counts(), **streamed.shape()} == replayed


def test_an_event_stream_that_is_not_a_dump_is_replayed_whole(tmp_path: Path) -> None:
    events = fleet_events()
    path = tmp_path / "events.jsonl"
    path.write_text(dump_lines(events))
    with pytest.raises(NotStreamable):
        DumpStats().add_all(events)
    code_and_out = kvctl("http://127.0.0.1:1", "tree", "stats", str(path), "-o", "json")
    assert json_of(code_and_out) == tree_stats(events)


def chains_dump(depth: int, chains: int = 8) -> Iterator[str]:
    """A Dynamo indexer's kind of dump, one block per edge, breadth first: `chains` prompts `depth` blocks deep,
    each held by two workers. Its lines are made as they are read: only the stream is ever in memory."""
    for level in range(depth):
        for c in range(chains):
            for worker in (c, (c + 1) % chains):
                parent = None if level == 0 else c * 10**9 + level - 1
                yield json.dumps({"worker_id": worker, "event": {"event_id": 0, "data": {"stored": {
                    "parent_hash": parent, "blocks": [{"block_hash": c * 10**9 + level,
                                                       "tokens_hash": c * 10**9 + level}]}}}}) + "\n"


def peak_bytes(depth: int) -> tuple[int, dict[str, object]]:
    tracemalloc.start()
    try:
        stats = DumpStats()
        stats.add_all(iter_dump_events(chains_dump(depth)))
        shape = stats.shape()
        return tracemalloc.get_traced_memory()[1], shape
    finally:
        tracemalloc.stop()


def test_stats_of_a_streamed_dump_take_memory_by_the_trees_width_not_its_size() -> None:
    small, shape = peak_bytes(500)
    large, _ = peak_bytes(5_000)  # ten times the dump: 80,000 events
    assert shape["paths"] == 8 * 500 and shape["shared_prefixes"][0]["depth"] == 500
    assert large < small * 1.5 and large < 1_000_000, (small, large)
    replayed = tree_stats(iter_dump_events(chains_dump(500)))
    assert {k: replayed[k] for k in shape} == shape


def wide_dump(tails: int, tail_blocks: int) -> Iterator[str]:
    """The benchmark's kind of tree, in kvctl's dump order: one prompt of 8 blocks held by four workers, then
    under it `tails` tails of `tail_blocks` blocks, each held by one of them."""
    def line(worker: int, parent: int | None, first: int, blocks: int) -> str:
        return json.dumps({"worker_id": worker, "event": {"event_id": 0, "data": {"stored": {
            "parent_hash": parent, "blocks": [{"block_hash": first + i, "tokens_hash": first + i}
                                              for i in range(blocks)]}}}}) + "\n"
    yield from (line(worker, None, 1, 8) for worker in range(4))
    yield from (line(t % 4, 8, 10**6 * (t + 1), tail_blocks) for t in range(tails))


def peak_of_wide(tail_blocks: int) -> tuple[int, dict[str, object]]:
    tracemalloc.start()
    try:
        stats = DumpStats()
        stats.add_all(iter_dump_events(wide_dump(400, tail_blocks)))
        figures = {**stats.counts(), **stats.shape()}
        return tracemalloc.get_traced_memory()[1], figures
    finally:
        tracemalloc.stop()


def test_a_wide_trees_stats_take_memory_by_its_nodes_not_its_blocks() -> None:
    """Every tail is in the widest level, which the pass keeps until the next: each tail costs a node, not
    its blocks (the 692 MB of a million pairs read block by block)."""
    short, figures = peak_of_wide(4)
    long, _ = peak_of_wide(64)  # 16 times the blocks
    assert long < short * 1.5, (short, long)
    assert figures == tree_stats(iter_dump_events(wide_dump(400, 4)))


async def test_the_routers_walk_lets_the_loop_run_between_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    # The walk looks at its clock between steps and yields once a slice is spent. Its clock here ticks a third
    # of a slice per look, so where it yields depends on the steps taken, never on how fast this machine is.
    ticks = iter(range(1 << 62))
    monkeypatch.setattr(tree_stats_http, "time", SimpleNamespace(perf_counter=lambda: next(ticks) * SLICE_S / 3))
    with survivors_frozen():  # the router's collector: a full collection of the index would hold the loop itself
        await _walk_while_probing()


async def _walk_while_probing() -> None:
    index = KvIndex()
    index.load(e for e in fleet_events(requests=30_000) if type(e.data) is Stored)
    ran = 0

    async def probe() -> None:
        nonlocal ran
        while True:
            await asyncio.sleep(0)
            ran += 1

    prober = asyncio.create_task(probe())
    await asyncio.sleep(0)
    ran_before = ran
    for _ in range(4):
        await index_shape(index, top=10)
    ran -= ran_before
    prober.cancel()
    # Never yielding, the four walks would let the prober run at most once; in slices, it runs between them.
    # How long a route waits behind a walk is benchmarks/scale_bench.py's.
    assert ran >= 10, ran


@pytest.mark.parametrize("offloaded", [False, True])
async def test_the_routers_walk_gives_what_its_dump_replayed_gives(offloaded: bool) -> None:
    """Node by node over the device tree; block by block when slower tiers' blocks join its paths."""
    events = [e for e in fleet_events() if type(e.data) is Stored]
    if offloaded:  # some workers' stores offloaded to host memory as well
        events += [RouterEvent(e.worker_id, Stored(e.data.parent_hash, e.data.block_hashes, e.data.tokens_hashes,
                                                   Tier.host_pinned), 0, e.event_id) for e in events[::3]]
    index = KvIndex()
    index.load(events)
    assert bool(index.lower) is offloaded
    replayed = tree_stats(index.dump(), top=4)
    assert await index_shape(index, top=4) == {k: replayed[k] for k in ("paths", "depths", "shared_prefixes")}
