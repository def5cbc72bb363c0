"""`kvctl doctor` on load and index shape, produced on a real router through its own API: requests reserved on
workers (the router's own load accounting), and an index fed over `POST /v1/events`."""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from kvctl.core.hashing import local_block_hashes, sequence_hashes
from tests.doctor.rig import doctor, findings
from tests.server.test_serve_process import serving
from tests.support.served import on_both_route_paths

BLOCK = 16


def stored(worker_id: int, tokens: list[int]) -> str:
    """A RouterEvent JSON line: `worker_id` stores `tokens`' full blocks as one chain from the root."""
    local = local_block_hashes(tokens, BLOCK)
    blocks = [{"block_hash": s, "tokens_hash": h} for s, h in zip(sequence_hashes(local), local, strict=True)]
    return json.dumps({"worker_id": worker_id, "event": {"event_id": 1, "data": {"stored": {
        "parent_hash": None, "blocks": blocks}}}})


def post_events(client: httpx.Client, lines: list[str]) -> None:
    answer = client.post("/v1/events", content="\n".join(lines), headers={"content-type": "application/x-ndjson"})
    assert answer.json()["rejected"] == {}, answer.text


@contextmanager
def publishing_workers(tmp_path: Path, count: int, **registration: int) -> Iterator[httpx.Client]:
    """A router with `count` registered workers (ids 1..count), each having sent one event (none is silent)."""
    with serving(tmp_path, "--no-restore") as (_, client):
        for worker_id in range(1, count + 1):
            assert client.post("/v1/workers", json={"worker_id": worker_id, **registration}).status_code == 201
        post_events(client, [stored(w, list(range(w * 1000, w * 1000 + BLOCK))) for w in range(1, count + 1)])
        yield client


def reserve(client: httpx.Client, request_id: str, tokens: int) -> int:
    """Route a fresh prompt of `tokens` tokens with reserve: the router counts it as the chosen worker's load."""
    base = zlib.crc32(request_id.encode())
    prompt = [(base + t) % 30_000 for t in range(tokens)]
    answer = client.post("/v1/route", json={"token_ids": prompt, "request_id": request_id, "reserve": True})
    assert answer.status_code == 200, answer.text
    return int(answer.json()["worker_id"])


@on_both_route_paths
def test_most_workers_busy_is_a_warning_naming_the_threshold_that_trips(tmp_path: Path) -> None:
    with publishing_workers(tmp_path, 3) as client:
        client.post("/busy_threshold", json={"model": "default", "active_prefill_tokens_threshold": 10})
        loaded = {reserve(client, "a", 64), reserve(client, "b", 64)}  # each over 10 queued prompt tokens
        code, report = doctor(str(client.base_url).rstrip("/"))
    [finding] = findings(report, "busy")
    assert len(loaded) == 2 and code == 1 and finding["severity"] == "WARNING"
    assert "2 of 3 workers" in finding["cause"] and "active_prefill_tokens" in finding["cause"]
    assert finding["evidence"]["tripped_by"] == {"active_prefill_tokens": 2}
    assert finding["evidence"]["tripped"] == {f"{w}:0": ["active_prefill_tokens 64 > 10"] for w in sorted(loaded)}


@on_both_route_paths
def test_a_full_cache_without_any_threshold_is_a_warning(tmp_path: Path) -> None:
    with publishing_workers(tmp_path, 2, total_blocks=10) as client:
        worker = reserve(client, "long", 10 * BLOCK)  # 10 blocks of decode on a 10-block worker
        code, report = doctor(str(client.base_url).rstrip("/"))
    [finding] = findings(report, "busy")
    assert code == 1 and finding["severity"] == "WARNING" and "no busy threshold is set" in finding["cause"]
    assert finding["evidence"]["kv_share"] == {f"{worker}:0": 1.0}
    assert "kvctl busy set" in finding["next_step"]


def test_an_index_of_short_branches_nobody_shares_is_named(tmp_path: Path) -> None:
    with publishing_workers(tmp_path, 2) as client:
        prompts = [list(range(n * BLOCK + 10**6, (n + 1) * BLOCK + 10**6)) for n in range(10_240)]  # a block each
        post_events(client, [stored(1 + n % 2, tokens) for n, tokens in enumerate(prompts)])
        code, report = doctor(str(client.base_url).rstrip("/"))
    [finding] = [f for f in findings(report, "index") if f["severity"] != "OK"]
    assert code == 1 and finding["severity"] == "WARNING" and "short branches nobody shares" in finding["cause"]
    assert finding["evidence"]["nodes_per_block"] == 1.0 and finding["evidence"]["blocks"] == 10_240 + 2
    assert finding["evidence"]["router_rss_bytes_per_block"] > 0


def test_an_index_of_shared_prompts_is_not_flagged(tmp_path: Path) -> None:
    with publishing_workers(tmp_path, 8) as client:
        prompt = list(range(1300 * BLOCK))  # one long prompt on every worker, a short suffix each: 10,912 blocks
        post_events(client, [stored(w, prompt + list(range(w * 10**6, w * 10**6 + 64 * BLOCK))) for w in range(1, 9)])
        code, report = doctor(str(client.base_url).rstrip("/"))
    [finding] = findings(report, "index")
    assert code == 0 and finding["severity"] == "OK", report
