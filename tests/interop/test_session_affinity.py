"""Session affinity on a Dynamo 1.6.1 fleet (issue 38): a frontend with `--router-session-affinity-ttl-secs` pins
each `x-dynamo-session-id` to a worker and publishes the binding on its `session_affinity_events` channel. kvctl
heard the channel and ignored it, picking the overlap holder where the frontend logged "Selected pinned worker".
A kvctl router given the same flag, following the fleet, must now pick the pinned worker, at the frontend's
logit, for a prompt cached on the other worker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.interop.fleet import Fleet, start_fleet, wait_until, words

ROUTER, SESSION = "following", "sess-interop"
AFFINITY = ["--router-session-affinity-ttl-secs", "30"]


@pytest.fixture(scope="module")
def pinning(dynamo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    workdir = tmp_path_factory.mktemp("interop-sessions")
    plane = ["--dynamo-discovery", f"file:{workdir / 'discovery'}", "--namespace", "dynamo", *AFFINITY]
    started = start_fleet(workdir, dynamo, mockers=2, indexer=False, kvctl=False, routers={ROUTER: plane},
                          frontend_args=AFFINITY)
    try:
        yield started
    finally:
        started.stop()


def test_a_session_pinned_by_the_frontend_gets_its_pick_in_kvctl(pinning: Fleet) -> None:
    url = pinning.routers[ROUTER].url

    def route(prompt: list[int], **body: Any) -> dict[str, Any]:
        answer = httpx.post(f"{url}/v1/route", json={"model": pinning.model, "token_ids": [t + 3 for t in prompt],
                                                     "explain": True, **body},
                            timeout=10)
        return answer.raise_for_status().json()

    def send(prompt: list[int], session: str | None = None) -> None:
        body = {"model": pinning.model, "messages": [{"role": "user", "content": words(prompt)}], "max_tokens": 1}
        headers = {"x-dynamo-session-id": session} if session else {}
        httpx.post(f"{pinning.frontend_url}/v1/chat/completions", json=body, headers=headers,
                   timeout=60).raise_for_status()

    def holder(prompt: list[int]) -> int | None:
        held = [c["worker_id"] for c in route(prompt)["candidates"] if c["overlap_blocks"] == 4]
        return held[0] if len(held) == 1 else None

    held_by: dict[int, list[int]] = {}  # a prompt of 4 blocks cached on each worker, sent without a session
    for n in range(16):
        prompt = list(range(100 + n * 64, 164 + n * 64))
        send(prompt)
        held_by.setdefault(wait_until(lambda p=prompt: holder(p), f"kvctl seeing prompt {n}", timeout=30,
                                      procs=pinning.procs), prompt)
        if len(held_by) == 2:
            break
    (a, on_a), (b, on_b) = held_by.items()
    send(on_a, SESSION)  # the session's first request: picked by cost, so pinned to a

    def pinned() -> dict[str, Any] | None:
        answer = route(on_b, session_id=SESSION)
        return answer if answer["reason"] == "pinned" else None

    answer = wait_until(pinned, "kvctl hearing the frontend's binding", timeout=30, procs=pinning.procs)
    assert answer["worker_id"] == a and route(on_b)["worker_id"] == b  # pinned over b, which holds the prompt
    before = len(pinning.frontend.pinned())
    send(on_b, SESSION)
    made = wait_until(lambda: pinning.frontend.pinned()[before:] or None, "the frontend's pinned pick", timeout=30,
                      procs=pinning.procs)
    worker, _, _, logit = made[0]
    assert worker == answer["worker_id"] and abs(answer["candidates"][0]["logit"] - logit) <= 5e-4, (made, answer)
