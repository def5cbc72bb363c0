"""Keyed tracking hashes on a Dynamo 1.6.1 fleet (issue 38): a frontend with `--router-tracking-hash keyed-xxh3-v1`
and replica sync shares its in-flight requests by keyed hashes. With a long request in flight, a router hashing
publicly priced its shared prefix as new decode load and picked the other worker where Dynamo picked the holder.
Two kvctl routers follow the fleet by replica sync, one given the frontend's key: its logits for a prompt that
shares the long request's prefix must be the frontend's; the other's, for the worker running it, higher."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.doctor.rig import doctor, findings
from tests.interop.fleet import Fleet, start_fleet, wait_until, words

KEYED, PUBLIC = "keyed", "public"


@pytest.fixture(scope="module")
def keyed_fleet(dynamo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    workdir = tmp_path_factory.mktemp("interop-keyed")
    key = workdir / "tracking.key"
    key.write_bytes(bytes(range(100, 132)))
    keyed = ["--router-tracking-hash", "keyed-xxh3-v1", "--router-tracking-key-file", str(key),
             "--router-tracking-key-id", "interop-1"]
    plane = ["--dynamo-discovery", f"file:{workdir / 'discovery'}", "--namespace", "dynamo", "--replica-sync",
             "--shadow"]
    started = start_fleet(workdir, dynamo, mockers=2, indexer=False, kvctl=False,
                          routers={KEYED: [*plane, *keyed], PUBLIC: plane}, mocker_args=["--speedup-ratio", "1"],
                          frontend_args=[*keyed, "--router-replica-sync"])
    try:
        yield started
    finally:
        started.stop()


def test_with_the_key_a_shared_prefix_in_flight_is_priced_as_the_frontend_prices_it(keyed_fleet: Fleet) -> None:
    fleet = keyed_fleet
    long_prompt = list(range(200, 328))  # 8 blocks
    shared = long_prompt[:96] + list(range(700, 732))  # its first 6 blocks, then 2 of its own

    def chat(prompt: list[int], max_tokens: int) -> None:
        body = {"model": fleet.model, "messages": [{"role": "user", "content": words(prompt)}],
                "max_tokens": max_tokens}
        httpx.post(f"{fleet.frontend_url}/v1/chat/completions", json=body, timeout=120).raise_for_status()

    def explained(router: str) -> dict[int, float]:
        answer = httpx.post(f"{fleet.routers[router].url}/v1/route", timeout=10,
                            json={"model": fleet.model, "token_ids": [t + 3 for t in shared],
                                  "explain": True}).raise_for_status().json()
        return {c["worker_id"]: c["logit"] for c in answer["candidates"]}

    def running(router: str) -> dict[str, Any] | None:
        rows = httpx.get(f"{fleet.routers[router].url}/v1/workers", timeout=10).json()["workers"]
        busy = [w for w in rows if w["active_requests"] and w["blocks"] >= 6]
        return busy[0] if busy else None

    long_request = threading.Thread(target=chat, args=(long_prompt, 600), daemon=True)
    long_request.start()
    try:
        holder = wait_until(lambda: running(KEYED), "the long request in flight, its blocks stored", timeout=60,
                            procs=fleet.procs)["worker_id"]
        wait_until(lambda: running(PUBLIC), "the public router seeing it too", timeout=30, procs=fleet.procs)
        keyed, public = explained(KEYED), explained(PUBLIC)
        before = len(fleet.frontend.decisions())
        chat(shared, 1)
        assert long_request.is_alive(), "the long request ended before the frontend's pick: it was not in flight"
    finally:
        long_request.join(120)
    worker, _, _, logit = wait_until(lambda: fleet.frontend.decisions()[before:] or None, "the frontend's pick",
                                     timeout=30, procs=fleet.procs)[0]
    assert keyed.get(worker) == logit and logit == min(keyed.values()), (worker, logit, keyed)
    assert public[holder] > keyed[holder], (public, keyed)  # its prefix in flight, unmatched: priced as new blocks


def test_without_the_key_doctor_names_the_frontends_keyed_hashes(keyed_fleet: Fleet) -> None:
    """Each peer request that ends is judged: its first tracking hash is in the index if public. After a few
    requests, the router without the key says the frontend's are keyed and what to pass; the one with it does not."""
    fleet = keyed_fleet
    for n in range(10):
        body = {"model": fleet.model, "messages": [{"role": "user", "content": words(range(n * 64, n * 64 + 64))}],
                "max_tokens": 2}
        httpx.post(f"{fleet.frontend_url}/v1/chat/completions", json=body, timeout=120).raise_for_status()

    def keyed_finding(router: str) -> list[dict[str, Any]]:
        _, report = doctor(fleet.routers[router].url)
        return [f for f in findings(report, "event_plane") if "keyed hashes" in f["cause"]]

    [finding] = wait_until(lambda: keyed_finding(PUBLIC) or None, "doctor naming the keyed hashes", timeout=30,
                           procs=fleet.procs)
    assert finding["severity"] == "WARNING" and finding["evidence"]["tracking"]["matched"] == 0
    assert "--router-tracking-hash keyed-xxh3-v1" in finding["next_step"]
    assert keyed_finding(KEYED) == []
    status = httpx.get(f"{fleet.routers[KEYED].url}/v1/status", timeout=10).json()
    assert status["event_plane"]["peers"]["tracking"] is None  # its own key: nothing to judge
