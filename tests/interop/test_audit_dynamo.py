"""The decision audit against a running Dynamo 1.6.1 fleet: every decision its frontend routes is heard from its
replica sync and judged against kvctl's index, beside the frontend's own decision counters.

The fleet's kvctl router follows its NATS event plane (KV events and the frontend's `AddRequest`s alike), so it
holds the frontend's index and hears its decisions in the order they were made.
"""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvctl.core.events.dump_file import read_timed_events
from kvctl.core.events.plane import ActiveSequenceEvent, AddRequest
from tests.commands.live_router import kvctl
from tests.commands.test_events_tail_record_replay import kvctl as kvctl_process
from tests.commands.test_events_tail_record_replay import serve
from tests.commands.test_record_decisions import POLICY, WHAT_IF, audit, foretold
from tests.interop.conftest import NATS_ROUTER, NATS_ROUTER_ID
from tests.interop.fleet import BLOCK_SIZE, Fleet, settled, shared_prefix_load, start_fleet, wait_until
from tests.nats_server import NatsServer

DYNAMO_BEST = "dynamo_component_router_kv_best_eligible_cached_prefix_tokens"
DYNAMO_SELECTED = "dynamo_component_router_kv_selected_cached_prefix_tokens"


def recent(url: str) -> dict[str, dict[str, Any]]:
    """The router's remembered decisions of Dynamo's routers (its own and its replica-sync peer's left out)."""
    body = httpx.get(f"{url}/v1/audit", params={"window": 86400, "recent": 1000}, timeout=10).json()
    return {d["request_id"]: d for d in body["recent"] if d["router"] not in ("kvctl", str(NATS_ROUTER_ID))}


def dynamo_counters(url: str) -> Counter[str]:
    """The frontend's decision counters, summed over their labels."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (f"{DYNAMO_BEST}_total", f"{DYNAMO_SELECTED}_total"):
                out[sample.name.removesuffix("_total")] += int(sample.value)
    return out


def test_every_frontend_decision_is_audited_and_its_avoidable_prefill_is_dynamos(fleet: Fleet) -> None:
    router = fleet.routers[NATS_ROUTER]
    before, decisions_before = set(recent(router.url)), len(fleet.frontend.decisions())
    counted_before = dynamo_counters(fleet.frontend_url)
    load = shared_prefix_load(fleet.frontend_url, requests=48, seed=44)
    assert not load.failed, load.failed
    made = len(fleet.frontend.decisions()) - decisions_before
    assert made == load.requests
    heard = wait_until(lambda: new if len(new := {k: v for k, v in recent(router.url).items() if k not in before})
                       >= made else None, f"kvctl auditing the frontend's {made} decisions", timeout=30,
                       procs=[router.proc])
    counted = settled(lambda: dynamo_counters(fleet.frontend_url), "the frontend's counters")
    verdicts = list(heard.values())
    outcomes = Counter(v["outcome"] for v in verdicts)
    reasons = Counter(v["reason"] for v in verdicts if v["outcome"] != "optimal")
    agreement = Counter(v["agreement"] for v in verdicts)
    report = f"outcomes {dict(outcomes)}, reasons {dict(reasons)}, agreement {dict(agreement)}"
    assert len(verdicts) == made, report
    summary = httpx.get(f"{router.url}/v1/audit", params={"window": 86400}, timeout=10).json()
    assert outcomes["unknown"] == 0 and summary["optimal_share"] >= 0.8, report
    disagreeing = [v for v in verdicts if v["agreement"] == "disagree"]
    assert all(v["reason"] == "index_behind" for v in disagreeing), report  # never a silent disagreement
    avoidable = sum(v["avoidable_tokens"] for v in verdicts)
    dynamo_avoidable = (counted[DYNAMO_BEST] - counted_before[DYNAMO_BEST]) - \
        (counted[DYNAMO_SELECTED] - counted_before[DYNAMO_SELECTED])
    assert avoidable == dynamo_avoidable, report
    assert sum(v["best_overlap"] for v in verdicts) > 0, report  # the load shares prefixes: there was cache to find
    # doctor sets the frontend's own counters beside the audit of the same decisions, all of them since it started
    doctor = kvctl(router.url, "doctor", "--metrics", f"{fleet.frontend_url}/metrics", "-o", "json")
    beside = next(f for f in json.loads(doctor.stdout)["findings"] if f["check"] == "router_counters")
    assert beside["severity"] == "OK" and len(beside["evidence"]["compared"]) == 1, (beside, summary["totals"])
    assert all(v["blocks"] > 0 and v["resolved_blocks"] <= v["blocks"] for v in verdicts)
    assert {v["role"] for v in verdicts} == {"aggregated"} and BLOCK_SIZE == 16


def test_a_frontend_that_ignores_the_cache_is_audited_as_poor_while_its_own_counters_read_zero(
        dynamo: Path, nats: NatsServer, tmp_path: Path) -> None:
    blind = start_fleet(tmp_path, dynamo, mockers=3, nats_url=nats.url, namespace="blind", kvctl=False,
                        indexer=False, frontend_args=["--router-kv-overlap-score-credit", "0"],
                        routers={NATS_ROUTER: ["--nats", nats.url, "--namespace", "blind", "--replica-sync",
                                               "--router-id", str(NATS_ROUTER_ID)]})
    try:
        router = blind.routers[NATS_ROUTER]
        wait_until(lambda: httpx.get(f"{router.url}/v1/status", timeout=5).json()["event_plane"]["ready"] or None,
                   "kvctl subscribed to the NATS event plane", timeout=30, procs=[router.proc])
        # Sixteen prefixes, four uses each: a router blind to the cache finds a prefix's holder by chance only.
        load = shared_prefix_load(blind.frontend_url, requests=64, prefixes=16, prefix_blocks=6, suffix_blocks=2,
                                  seed=45)
        assert not load.failed, load.failed
        made = len(blind.frontend.decisions())
        heard = wait_until(lambda: d if len(d := recent(router.url)) >= made else None,
                           f"kvctl auditing the frontend's {made} decisions", timeout=30, procs=[router.proc])
        counted = settled(lambda: dynamo_counters(blind.frontend_url), "the frontend's counters")
        summary = httpx.get(f"{router.url}/v1/audit", params={"window": 86400}, timeout=10).json()
        doctor = kvctl(router.url, "doctor", "--metrics", f"{blind.frontend_url}/metrics", "-o", "json")
    finally:
        blind.stop()
    routing = next(f for f in json.loads(doctor.stdout)["findings"] if f["check"] == "routing")
    verdicts = list(heard.values())
    outcomes = Counter(v["outcome"] for v in verdicts)
    reasons = Counter(v["reason"] for v in verdicts if v["outcome"] != "optimal")
    report = f"outcomes {dict(outcomes)}, reasons {dict(reasons)}; dynamo {dict(counted)}"
    assert counted[DYNAMO_BEST] == counted[DYNAMO_SELECTED] == 0, report  # the router's self-report is blind
    assert summary["optimal_share"] <= 0.75 and summary["avoidable_prefill_tokens"] > 0, report
    # Named: each pick holding cache the router credited with none, then, once three have shown it never credits
    # any, every pick short of the most cache (those before may be load balance, or unexplained: a pick kvctl
    # prices higher holding no cache, which a router crediting cache might make too).
    assert reasons["cache_ignored"] >= 3, report
    third = [n for n, v in enumerate(verdicts) if v["reason"] == "cache_ignored"][2]  # verdicts: in the order judged
    after = Counter(v["reason"] for v in verdicts[third:] if v["outcome"] == "suboptimal")
    assert set(after) == {"cache_ignored"}, f"{report}; after the third cache_ignored: {dict(after)}"
    assert routing["severity"] == "CRITICAL" and "own decision counters read 0" in routing["cause"], routing


def test_decisions_to_a_restarted_mocker_are_never_put_down_to_bad_routing(
        dynamo: Path, nats: NatsServer, tmp_path: Path) -> None:
    # Restarted, a mocker is a new worker to Dynamo (a new instance id) with an empty cache; the frontend may route
    # to it before kvctl has heard it register, and for a while after, kvctl's view of it is not whole. Every
    # decision to it short of the most cache is kvctl's view being behind, never bad routing: the load after the
    # restart lasts well under the 30 s kvctl gives a worker that joined mid-load.
    fleet = start_fleet(tmp_path, dynamo, mockers=3, nats_url=nats.url, namespace="restarted", kvctl=False,
                        indexer=False, routers={NATS_ROUTER: ["--nats", nats.url, "--namespace", "restarted",
                                                              "--replica-sync", "--router-id", str(NATS_ROUTER_ID)]})
    try:
        router = fleet.routers[NATS_ROUTER]
        wait_until(lambda: httpx.get(f"{router.url}/v1/status", timeout=5).json()["event_plane"]["ready"] or None,
                   "kvctl subscribed to the NATS event plane", timeout=30, procs=[router.proc])
        shared_prefix_load(fleet.frontend_url, requests=24, seed=50)
        before = set(recent(router.url))
        victim = fleet.mockers[0]
        fleet.restart_mocker(victim)
        fleet.await_mocker(victim)
        load = shared_prefix_load(fleet.frontend_url, requests=48, seed=51)
        assert not load.failed, load.failed
        heard = wait_until(lambda: d if len(d := {k: v for k, v in recent(router.url).items() if k not in before})
                           >= load.requests else None, "kvctl auditing the decisions after the restart", timeout=40,
                           procs=[router.proc])
    finally:
        fleet.stop()
    to_it = [v for v in heard.values() if v["worker_id"] == victim.dynamo_id]
    reasons = Counter((v["outcome"], v["reason"]) for v in to_it)
    assert to_it, "the frontend never routed to the restarted mocker"
    assert set(reasons) <= {("optimal", "max_overlap"), ("optimal", "no_overlap"), ("unknown", "index_behind"),
                            ("suboptimal", "index_behind")}, reasons
    behind = [v for v in to_it if v["reason"] == "index_behind"]
    assert all("not registered" in v["stale"].get(f"{victim.dynamo_id}:0", "") for v in behind
               if v["outcome"] == "unknown"), behind



def test_what_if_on_a_recording_answers_as_a_router_started_with_those_knobs(
        dynamo: Path, nats: NatsServer, tmp_path: Path) -> None:
    # The fleet's KV events and its frontend's decisions recorded from its start, then replayed into two routers:
    # one with the defaults, asked --what-if, and one started with those knobs (a policy file), whose audit of
    # the same decisions is what the what-if foretells: the same picks changed, the same avoidable prefill.
    fleet = start_fleet(tmp_path / "fleet", dynamo, mockers=3, nats_url=nats.url, namespace="recorded",
                        kvctl=False, indexer=False)
    recording = tmp_path / "rec.jsonl"
    try:
        recorder = kvctl_process("events", "record", str(recording), "--nats", nats.url, "--namespace", "recorded",
                                 "--decisions", "--duration", "300", "-o", "json")
        assert recorder.stderr is not None and recorder.stderr.readline().startswith("listening on ")
        load = shared_prefix_load(fleet.frontend_url, requests=48, seed=46)
        assert not load.failed, load.failed
        made = len(fleet.frontend.decisions())
        wait_until(lambda: routed(recording) >= made or None, f"the recording holding the frontend's {made} "
                   "decisions", timeout=30)
        settled(lambda: recording.stat().st_size, "the recording")
        recorder.send_signal(signal.SIGINT)
        out, err = recorder.communicate(timeout=30)
    finally:
        fleet.stop()
    assert recorder.returncode == 0 and json.loads(out)["gaps"] == 0, err
    assert routed(recording) == made
    (tmp_path / "policy.yaml").write_text(POLICY)
    with serve(tmp_path, state="plain") as plain, \
            serve(tmp_path, "--router-policy-config", str(tmp_path / "policy.yaml"), state="other") as other:
        for url in (plain, other):
            replay = kvctl_process("--server", url, "events", "replay", str(recording), "--yes", "-o", "json")
            out, err = replay.communicate(timeout=60)
            assert replay.returncode == 0, err  # recorded from the start: every event applies
            assert json.loads(out)["decisions"]["audited"] == made
        here = audit(plain, *(f"--what-if={k}" for k in WHAT_IF))
        there = audit(other, "--recent", "1000")
    judged = foretold(here["what_if"], there, BLOCK_SIZE)
    assert len(judged) == made - before_first_event(recording)
    # credit 0 forgoes the cache the frontend's picks found
    assert here["optimal_share"] >= 0.8 > here["what_if"]["optimal_share_then"], here
    assert here["what_if"]["avoidable_prefill_tokens_then"] > here["avoidable_prefill_tokens"], here


def before_first_event(recording: Path) -> int:
    """The recording's decisions for a worker none of its KV events has named yet: a replay's router has not heard
    of that worker then, so they are judged `unknown` (the live router knew it from discovery)."""
    heard: set[tuple[int, int]] = set()
    early = 0
    for _, item in read_timed_events(recording.read_text()):
        if isinstance(item, ActiveSequenceEvent):
            early += isinstance(item.action, AddRequest) and (item.worker_id, item.dp_rank) not in heard
        else:
            heard.add(item.worker)
    return early


def routed(recording: Path) -> int:
    """The frontend's AddRequests in the recording so far."""
    return sum('"AddRequest"' in line for line in recording.read_text().splitlines())
