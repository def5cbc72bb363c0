"""The model cards of a Dynamo 1.6.1 disaggregated fleet, read by `kvctl serve --dynamo-discovery` (issue 38):
two prefill and two decode mockers at 32-token blocks, Dynamo's frontend, and two kvctl routers on the fleet's
file discovery, one given no block size and one given 16. Each worker's role comes from its card; the decode
workers, which publish no KV events by design, are not called silent; the router given no block size takes the
cards' 32, and the one at 16 is told, CRITICAL, what block size the fleet uses, where it said OK before."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.commands.live_router import kvctl
from tests.doctor.rig import doctor, findings
from tests.interop.fleet import VOCAB, Fleet, shared_prefix_load, start_fleet, wait_until, words
from tests.nats_server import NatsServer

ADOPTING, AT_16, APPROXIMATE = "cards", "cards16", "approximate"


@pytest.fixture(scope="module")
def disaggregated(dynamo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    workdir = tmp_path_factory.mktemp("interop-cards")
    plane = ["--dynamo-discovery", f"file:{workdir / 'discovery'}", "--namespace", "dynamo"]
    started = start_fleet(workdir, dynamo, modes=["prefill", "prefill", "decode", "decode"], indexer=False,
                          kvctl=False, block_size=32, routers={AT_16: [*plane, "--block-size", "16"],
                                                               APPROXIMATE: [*plane, "--approximate"]})
    try:
        started.await_router(started.start_router(ADOPTING, *plane, block_size=False))
        yield started
    finally:
        started.stop()


def _workers(url: str) -> dict[int, dict[str, Any]]:
    return {w["worker_id"]: w for w in httpx.get(f"{url}/v1/workers", timeout=10).json()["workers"]}


def _cards(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/v1/status", timeout=10).json()["event_plane"]["model_cards"]


def _every_prefill_worker_stored(fleet: Fleet, url: str) -> None:
    """Cold prompts through the frontend until each prefill worker has sent kvctl an event: a cold prompt's pick
    is a coin toss between them, and one never picked is rightly a doctor WARNING (why is it left out?)."""
    prefill = [m.worker_id for m in fleet.mockers[:2]]  # start_fleet's modes: prefill, prefill, decode, decode
    sent = itertools.count()

    def stored() -> bool | None:
        rows = _workers(url)
        if all(rows.get(w, {}).get("last_event_age_s") is not None for w in prefill):
            return True
        k = next(sent)
        prompt = list(range(20_000 + k * 64, 20_064 + k * 64))
        body = {"model": fleet.model, "messages": [{"role": "user", "content": words(prompt)}], "max_tokens": 1}
        httpx.post(f"{fleet.frontend_url}/v1/chat/completions", json=body, timeout=60).raise_for_status()
        return None

    wait_until(stored, "an event from each prefill worker", timeout=120, procs=fleet.procs)


def test_roles_and_the_block_size_come_from_the_cards_and_decode_workers_are_silent_by_design(
        disaggregated: Fleet) -> None:
    url = disaggregated.routers[ADOPTING].url
    assert shared_prefix_load(disaggregated.frontend_url, requests=16).failed == []
    prefill = {m.worker_id for m in disaggregated.mockers[:2]}
    decode = {m.worker_id for m in disaggregated.mockers[2:]}
    def with_roles() -> dict[int, dict[str, Any]] | None:
        rows = _workers(url)
        return rows if {w for w, row in rows.items() if row["role"]} >= prefill | decode else None

    rows = wait_until(with_roles, "every worker's role from its card", timeout=30, procs=disaggregated.procs)
    _every_prefill_worker_stored(disaggregated, url)
    assert {w: rows[w]["role"] for w in prefill | decode} == {**dict.fromkeys(prefill, "prefill"),
                                                              **dict.fromkeys(decode, "decode")}
    assert all(rows[w]["publishes_kv_events"] is False for w in decode)
    assert all(rows[w]["total_blocks"] == 128 for w in prefill | decode)  # the mockers' --num-gpu-blocks-override
    assert all(rows[w]["max_num_batched_tokens"] == 8192 for w in prefill | decode)  # the mocker's default
    assert _cards(url)["models"] == {"tiny": {"block_sizes": [32], "roles": {"prefill": 2, "decode": 2},
                                              "workers": 4, "silent_by_design": 2}}
    code, report = doctor(url, "--silent-after", "3600")
    assert code == 0, report  # the healthy fleet is OK (issue 38's acceptance), decode workers and all
    by_design = next(f for f in findings(report, "silent") if "silent by design" in f["cause"])
    assert by_design["severity"] == "OK" and set(by_design["evidence"]["workers"]) == {f"{w}:0" for w in decode}
    [block_size] = findings(report, "block_size")
    assert block_size["severity"] == "OK" and "model 'tiny'" in block_size["cause"], block_size
    [workers] = findings(report, "workers")
    assert "disaggregated fleet: by their model cards this model has 2 prefill workers and 2 decode workers, " \
        "routed as two pools" in workers["cause"]
    route = httpx.post(f"{url}/v1/route", json={"model": "tiny", "token_ids": list(range(64))}, timeout=10).json()
    assert (route["role"], route["decode"]["role"]) == ("prefill", "decode")
    assert route["worker_id"] in prefill and route["decode"]["worker_id"] in decode
    rows_shown = [row.split() for row in kvctl(url, "workers").stdout.splitlines()[1:]]  # WORKER DP MODEL ROLE …
    listed = {int(row[0]): row[3] for row in rows_shown}
    assert {listed[w] for w in prefill} == {"prefill"} and {listed[w] for w in decode} == {"decode"}
    tokens = [str(t) for t in range(64)]
    table = kvctl(url, "route", *tokens).stdout.splitlines()  # a row per pick, each naming its pool
    assert table[0].split()[:2] == ["POOL", "WORKER"] and [row.split()[0] for row in table[1:]] == ["prefill",
                                                                                                     "decode"]
    explained = kvctl(url, "route", "--explain", *tokens).stdout
    assert "prefill pool routed to" in explained and "decode pool routed to" in explained
    assert kvctl(url, "route", "--reserve", "--request-id", "r", "--yes", *tokens).exit_code == 1
    stats = httpx.get(f"{url}/v1/tree/stats", timeout=10).json()["models"]["tiny"]
    assert stats["block_size"] == 32 and sum(stats["workers"].values()) > 0  # the cards' size, and it indexes


def test_twenty_prompts_get_the_frontends_prefill_and_decode_picks(disaggregated: Fleet) -> None:
    """The issue-38 acceptance on the ZMQ plane."""
    twenty_prompts_get_the_frontends_picks(disaggregated)


def twenty_prompts_get_the_frontends_picks(disaggregated: Fleet) -> None:
    """Twenty prompts, one after another, each one of four 4-block prefixes then a 2-block suffix of its own, sent
    through the frontend as chats; before each, kvctl explains the same prompt. The frontend's prefill pick must be
    among kvctl's lowest prefill logits, at the logit it logged, and so must its decode pick among kvctl's decode
    logits. A prompt's prefix was stored four prompts before it, so both routers have long since seen the events
    its overlap depends on; kvctl is first made to show the previous prompt's blocks, so nothing it missed can
    pass as a different pick."""
    url, b = disaggregated.routers[ADOPTING].url, disaggregated.block_size
    frontend = disaggregated.frontend
    # Prefixes that start where no earlier test's prompt does (theirs start at multiples of 192).
    prefixes = [list(range(50 + p * 4 * b, 50 + (p + 1) * 4 * b)) for p in range(4)]
    prompts = [prefixes[i % 4] + list(range(i * 2 * b, (i + 1) * 2 * b)) for i in range(20)]

    def explained(prompt: list[int]) -> dict[str, Any]:
        tokens = [t % VOCAB + 3 for t in prompt]  # what words() turns into
        return httpx.post(f"{url}/v1/route", json={"model": "tiny", "token_ids": tokens, "explain": True},
                          timeout=10).json()

    def lowest(pick: dict[str, Any]) -> dict[int, float]:
        logits = {c["worker_id"]: c["logit"] for c in pick["candidates"]}
        return {w: v for w, v in logits.items() if v == min(logits.values())}

    def cached(prompt: list[int]) -> bool:
        return max(c["overlap_blocks"] for c in explained(prompt)["candidates"]) == 6

    def picked(after: int) -> list[tuple[int, int, str, float]] | None:
        made = frontend.decisions()[after:]
        return made if len(made) >= 2 else None

    wait_until(lambda: "decode" in explained(prompts[0]) or None, "kvctl routing the fleet as two pools, by its "
               "cards", timeout=30, procs=disaggregated.procs)
    seen = []
    with httpx.Client(base_url=disaggregated.frontend_url, timeout=60) as client:
        for i, prompt in enumerate(prompts):
            if i:  # the previous prompt's six blocks in kvctl's index
                wait_until(partial(cached, prompts[i - 1]), f"kvctl seeing prompt {i - 1}'s blocks", timeout=30,
                           procs=disaggregated.procs)
            answer = explained(prompt)
            before = len(frontend.decisions())
            body = {"model": disaggregated.model, "messages": [{"role": "user", "content": words(prompt)}],
                    "max_tokens": 1}
            client.post("/v1/chat/completions", json=body).raise_for_status()
            made = wait_until(partial(picked, before), f"the frontend's two picks for prompt {i}", timeout=30,
                              procs=disaggregated.procs)
            picks = {kind: (worker, logit) for worker, _, kind, logit in made[:2]}
            for kind, pick in (("prefill", answer), ("decode", answer["decode"])):
                worker, logit = picks[kind]
                assert lowest(pick).get(worker) == logit, (i, kind, picks[kind], pick["candidates"])
            seen.append((answer["overlap_blocks"], picks["prefill"][1], picks["decode"][1]))
    # Cold prefixes, then each one cached: 6 blocks to prefill, then 2; a decode pick weighs the 6 blocks alone.
    assert seen[:4] == [(0, 6.0, 6.0)] * 4 and set(seen[4:]) == {(4, 2.0, 6.0)}, seen


def test_a_router_at_another_block_size_than_the_cards_is_critical(disaggregated: Fleet) -> None:
    url = disaggregated.routers[AT_16].url
    wait_until(lambda: _cards(url)["cards"] == 4 and _workers(url) or None, "the cards read and workers known",
               timeout=30, procs=disaggregated.procs)
    code, report = doctor(url)
    [block_size] = findings(report, "block_size")
    assert code == 2 and block_size["severity"] == "CRITICAL", block_size
    assert block_size["next_step"] == "restart kvctl serve with --block-size 32"


def test_an_approximate_router_on_the_plane_indexes_its_routes_not_the_fleets_events(disaggregated: Fleet) -> None:
    """`--approximate` on a discovery fleet still applied the fleet's KV events while doctor said the router
    indexes its own routes (issue 38). As Dynamo's --no-router-kv-events: counted, not applied."""
    url = disaggregated.routers[APPROXIMATE].url
    assert shared_prefix_load(disaggregated.frontend_url, requests=8, seed=11).failed == []

    def ignored() -> int:
        counts = httpx.get(f"{url}/v1/status", timeout=10).json()["event_plane"]["counts"]
        return int(counts.get("core_kv_events_ignored", 0))

    wait_until(lambda: ignored() > 0, "the fleet's KV events reaching the approximate router", timeout=30,
               procs=disaggregated.procs)
    stats = httpx.get(f"{url}/v1/tree/stats", timeout=10).json()["models"]
    assert all(m["blocks"] == 0 for m in stats.values())  # nothing from the fleet's events: only its routes index
    _, report = doctor(url)
    assert findings(report, "silent")[0]["cause"].startswith("approximate mode: the router indexes its own routes")


@pytest.fixture(scope="module")
def nats_disaggregated(dynamo: Path, nats: NatsServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The same fleet's shape on the NATS event plane (its own namespace on the package's nats-server), and a kvctl
    router on it that reads the workers' model cards from the fleet's file discovery."""
    workdir = tmp_path_factory.mktemp("interop-cards-nats")
    plane = ["--nats", nats.url, "--dynamo-discovery", f"file:{workdir / 'discovery'}", "--namespace", "disagg"]
    started = start_fleet(workdir, dynamo, modes=["prefill", "prefill", "decode", "decode"], indexer=False,
                          kvctl=False, block_size=32, nats_url=nats.url, namespace="disagg",
                          routers={ADOPTING: plane})
    try:
        yield started
    finally:
        started.stop()


def test_on_nats_twenty_prompts_get_the_frontends_prefill_and_decode_picks(nats_disaggregated: Fleet) -> None:
    """The issue-38 acceptance on the NATS plane: before it read model cards, all four workers were one pool of
    model `default`, and 4 of 8 cold prompts went to a decode worker. Then doctor on the healthy fleet is OK."""
    url = nats_disaggregated.routers[ADOPTING].url
    wait_until(lambda: _cards(url)["cards"] == 4 or None, "the cards read", timeout=30,
               procs=nats_disaggregated.procs)
    twenty_prompts_get_the_frontends_picks(nats_disaggregated)
    _every_prefill_worker_stored(nats_disaggregated, url)
    code, report = doctor(url, "--silent-after", "3600")
    assert code == 0, report
    [workers] = findings(report, "workers")
    assert "2 prefill workers and 2 decode workers, routed as two pools" in workers["cause"], workers


@pytest.fixture(scope="module")
def sglang_fleet(dynamo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Two SGLang-style mockers at page size 32 and a kvctl router given no block size."""
    workdir = tmp_path_factory.mktemp("interop-sglang")
    started = start_fleet(workdir, dynamo, mockers=2, indexer=False, kvctl=False, block_size=32,
                          mocker_args=["--engine-type", "sglang", "--sglang-page-size", "32"])
    try:
        plane = ["--dynamo-discovery", f"file:{workdir / 'discovery'}", "--namespace", "dynamo"]
        started.await_router(started.start_router(ADOPTING, *plane, block_size=False))
        yield started
    finally:
        started.stop()


def test_an_sglang_fleet_at_page_32_is_scored_as_dynamo_with_no_block_size_given(sglang_fleet: Fleet) -> None:
    """Given no --block-size, kvctl left at 16 saw overlap 0 and logit 22.0 on every candidate where Dynamo logged
    4 blocks and logit 6.5 (issue 38). The arbiter is the frontend's own log: a prompt of five pages sent twice,
    the second pick with its logit; kvctl, idle as the frontend was, must pick the same worker at that logit."""
    url = sglang_fleet.routers[ADOPTING].url
    wait_until(lambda: _cards(url)["cards"] == 2 or None, "the cards read", timeout=30, procs=sglang_fleet.procs)
    prompt = list(range(160))  # five pages of 32 tokens
    body = {"model": sglang_fleet.model, "messages": [{"role": "user", "content": words(prompt)}], "max_tokens": 1}

    def explained() -> dict[str, Any] | None:
        body = {"model": "tiny", "token_ids": [t + 3 for t in prompt], "explain": True}
        answer = httpx.post(f"{url}/v1/route", json=body, timeout=10).json()
        return answer if max(c["overlap_blocks"] for c in answer["candidates"]) == 5 else None

    with httpx.Client(base_url=sglang_fleet.frontend_url, timeout=60) as client:
        client.post("/v1/chat/completions", json=body).raise_for_status()
        # The second decision waits for the first's pages to be on the event plane: kvctl, following the same plane
        # as the frontend, has them (without this barrier the frontend once decided before they reached it).
        wait_until(explained, "kvctl seeing the prompt's five pages", timeout=30, procs=sglang_fleet.procs)
        client.post("/v1/chat/completions", json=body).raise_for_status()
    (_, _, _, cold), (worker, rank, _, warm) = sglang_fleet.frontend.decisions()[-2:]
    assert (cold, warm) == (10.0, 5.0)  # 5 prefill + 5 decode blocks; then the 5 prefill blocks cached
    answer = wait_until(explained, "kvctl seeing the prompt's five pages", timeout=30, procs=sglang_fleet.procs)
    assert (answer["worker_id"], answer["dp_rank"]) == (worker, rank)
    logits = {c["worker_id"]: c["logit"] for c in answer["candidates"]}
    assert logits.pop(worker) == warm and list(logits.values()) == [cold]
