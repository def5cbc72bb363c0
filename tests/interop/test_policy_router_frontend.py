"""A `--router-policy-config` file's `router:` section against a live Dynamo 1.6.1 frontend (issue 44).

1. Each file below is given to `python -m dynamo.frontend` and to kvctl: what the frontend refuses to start with,
   kvctl refuses with the frontend's message (kvctl adds where, never changes the words); what it starts with,
   kvctl takes, or refuses as kvctl's own limit ("is not taken by kvctl serve").
2. A fleet whose frontend runs with a file setting tier weights and turning prompt-side prefill tracking off: for
   every request, kvctl started with the same file prices the frontend's pick at the frontend's logged logit, and
   that is its lowest; kvctl started with the equivalent flags prices every worker the same, and so does a second
   frontend started with those flags; a kvctl with neither (the defaults) prices them otherwise. The 1.6.1 mocker
   publishes no host or disk tier (its `--num-host-blocks` offload sends no tier events, and the frontend did not
   index tiered events published on its plane), so on this fleet the tier weights are taken but score nothing:
   their effect on picks is checked against Dynamo's `SelectionService` (test_selection_differential.py,
   `policy_router_*` scenarios).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvctl.commands._serve_routing import FleetOptions, TrackingHash, fleet_options, read_policy
from kvctl.core.router.approx_lru import CachePolicy
from kvctl.errors import UsageError
from tests.interop.fleet import BLOCK_SIZE, Fleet, Proc, free_port, start_fleet, wait_until, words

SECTION = "router:\n  host_cache_hit_weight: 0.5\n  disk_cache_hit_weight: 0.1\n  router_track_prefill_tokens: false\n"
KVCTL_FLAGS = ["--host-cache-hit-weight", "0.5", "--disk-cache-hit-weight", "0.1", "--no-track-prefill-tokens"]
DYNAMO_FLAGS = ["--router-host-cache-hit-weight", "0.5", "--router-disk-cache-hit-weight", "0.1",
                "--no-router-track-prefill-tokens"]
SERVE_DEFAULTS = FleetOptions(approximate=False, router_ttl=120.0, cache_policy=CachePolicy.ttl,
                              tracking_hash=TrackingHash.public, tracking_key_file=None, tracking_key_id=None,
                              replica_sync=False)

FILES = {
    "tiers_and_no_prefill_tracking": SECTION,
    "empty": "router: {}\n",
    "int_weight": "router:\n  host_cache_hit_weight: 1\n",
    "approximate_lru": "router:\n  use_kv_events: false\n  router_approximate_cache_policy: lru\n"
                       "  router_ttl_secs: 30\n",
    "keyed": "router:\n  router_tracking_hash: keyed-xxh3-v1\n  router_tracking_key_file: {key}\n"
             "  router_tracking_key_id: k1\n",
    "inert": "router:\n  router_event_threads: 2\n  serve_indexer: true\n",
    "output_blocks": "router:\n  router_track_output_blocks: true\n",  # Dynamo starts; kvctl cannot route so
    "unknown": "router:\n  bogus: 1\n  overlap_score_credit: 0.5\n",
    "not_a_map": "router: 3\n",
    "string_weight": "router:\n  host_cache_hit_weight: '0.5'\n",
    "yaml11_exponent": "router:\n  router_ttl_secs: 1e3\n",
    "yaml11_bool": "router:\n  router_track_prefill_tokens: yes\n",
    "yaml11_underscore": "router:\n  router_ttl_secs: 1_000.5\n",
    "nan": "router:\n  disk_cache_hit_weight: .nan\n",
    "int_for_bool": "router:\n  use_kv_events: 0\n",
    "float_threads": "router:\n  router_event_threads: 2.0\n",
    "negative_threads": "router:\n  router_event_threads: -1\n",
    "zero_threads": "router:\n  router_event_threads: 0\n",
    "weight_above_one": "router:\n  host_cache_hit_weight: 1.5\n",
    "negative_ttl": "router:\n  router_ttl_secs: -1\n",
    "bad_hash": "router:\n  router_tracking_hash: sha\n",
    "bad_cache_policy": "router:\n  router_approximate_cache_policy: fifo\n",
    "lru_with_events": "router:\n  router_approximate_cache_policy: lru\n",
    "keyed_without_key": "router:\n  router_tracking_hash: keyed-xxh3-v1\n",
    "key_without_keyed": "router:\n  router_tracking_key_id: k1\n",
    "output_without_active": "router:\n  router_track_output_blocks: true\n  router_track_active_blocks: false\n",
    "both_indexers": "router:\n  serve_indexer: true\n  use_remote_indexer: true\n",
    "predicted_without_events": "router:\n  use_kv_events: false\n  router_predicted_ttl_secs: 10\n",
}


def frontend_verdict(python: Path, policy: Path, workdir: Path) -> str | None:
    """The frontend's refusal of `policy` (its exception's message), or None once it serves on its HTTP port."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DYN_", "NATS_", "KVCTL_", "HF_"))}
    env.update(DYN_FILE_KV=str(workdir / "discovery"), HOME=str(workdir), HF_HUB_OFFLINE="1",
               DYN_TCP_RPC_HOST="127.0.0.1", DYN_EVENT_PLANE_HOST="127.0.0.1", PYTHONUNBUFFERED="1")
    proc = Proc(policy.stem, [python, "-m", "dynamo.frontend", "--router-mode", "kv", "--http-host", "127.0.0.1",
                              "--http-port", port, "--discovery-backend", "file", "--request-plane", "tcp",
                              "--event-plane", "zmq", "--router-policy-config", policy], workdir / "frontend.log", env)

    def outcome() -> str | None:
        if not proc.alive:
            return "exited"
        with socket.socket() as sock:
            return "serving" if sock.connect_ex(("127.0.0.1", port)) == 0 else None

    try:
        verdict = wait_until(outcome, f"the frontend starting or refusing {policy.name}", timeout=60)
    finally:
        proc.stop()
    if verdict == "serving":
        return None
    last = proc.tail(1).strip()
    assert last.startswith(("ValueError: ", "OverflowError: ")), proc.report()
    return last.split(": ", 1)[1]


def kvctl_verdict(policy: Path) -> str | None:
    """kvctl serve's refusal of `policy` (less its `--router-policy-config FILE: ` prefix), or None."""
    try:
        fleet_options(SERVE_DEFAULTS, None, read_policy(policy), policy)
    except UsageError as exc:
        return str(exc).removeprefix(f"--router-policy-config {policy}: ")
    return None


@pytest.mark.parametrize("name", FILES)
def test_a_router_section_is_taken_or_refused_as_the_frontend_does(name: str, dynamo: Path, tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_bytes(bytes(range(32)))
    policy = tmp_path / f"{name}.yaml"
    policy.write_text(FILES[name].replace("{key}", str(key)))
    (tmp_path / "discovery").mkdir()
    theirs, ours = frontend_verdict(dynamo, policy, tmp_path), kvctl_verdict(policy)
    if theirs is not None:
        assert ours is not None and ours.startswith(theirs), (theirs, ours)  # the frontend's words, first
    else:
        assert ours is None or " is not taken by kvctl serve: " in ours, ours


# ----- the same picks --------------------------------------------------------------------------------------------

YAML, FLAGS, DEFAULTS = "yaml", "flags", "defaults"


@pytest.fixture(scope="module")
def section_fleet(dynamo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    workdir = tmp_path_factory.mktemp("interop-policy-router")
    policy = workdir / "policy.yaml"
    policy.write_text(SECTION)
    plane = ["--dynamo-discovery", f"file:{workdir / 'discovery'}", "--namespace", "dynamo", "--shadow"]
    started = start_fleet(workdir, dynamo, mockers=2, indexer=False, kvctl=False,
                          routers={YAML: [*plane, "--router-policy-config", str(policy)],
                                   FLAGS: [*plane, *KVCTL_FLAGS], DEFAULTS: plane},
                          frontend_args=["--router-policy-config", str(policy)])
    try:
        started.await_frontend(started.start_frontend("frontend-flags", *DYNAMO_FLAGS))
        yield started
    except BaseException:
        started.stop()
        raise
    started.stop()


def prompts() -> list[list[int]]:
    """Whole blocks of 16; later ones share prefixes of earlier ones, so overlaps differ from worker to worker."""
    a, b, c = (list(range(base, base + 8 * BLOCK_SIZE)) for base in (0, 300, 600))
    new = [list(range(base, base + 2 * BLOCK_SIZE)) for base in range(900, 1000, 32)]
    return [a[:96], a[:64] + new[0], b[:96], a, b[:32] + new[1], c[:48], a[:96] + new[2], b, c, a[:64] + new[0]]


def explained(fleet: Fleet, router: str, tokens: list[int]) -> dict[int, tuple[int, float]]:
    answer = httpx.post(f"{fleet.routers[router].url}/v1/route", timeout=10,
                        json={"model": fleet.model, "token_ids": tokens, "explain": True}).raise_for_status().json()
    return {c["worker_id"]: (c["overlap_blocks"], c["logit"]) for c in answer["candidates"]}


def test_kvctl_given_the_file_picks_as_the_frontend_given_it(section_fleet: Fleet) -> None:
    fleet = section_fleet
    differs_from_defaults = 0
    for n, prompt in enumerate(prompts()):
        frontend = fleet.frontends[n % 2]  # the file's frontend, then the one given the equivalent flags
        tokens = [t + 3 for t in prompt]  # words(i) is token i + 3
        routes = {router: explained(fleet, router, tokens) for router in (YAML, FLAGS, DEFAULTS)}
        assert routes[YAML] == routes[FLAGS], (n, routes)
        differs_from_defaults += routes[YAML] != routes[DEFAULTS]
        before = len(frontend.decisions())
        body = {"model": fleet.model, "messages": [{"role": "user", "content": words(prompt)}], "max_tokens": 1}
        httpx.post(f"{frontend.url}/v1/chat/completions", json=body, timeout=60).raise_for_status()
        worker, _, _, logit = wait_until(lambda f=frontend, b=before: f.decisions()[b:] or None,
                                         f"{frontend.proc.name}'s pick of prompt {n}", timeout=30,
                                         procs=fleet.procs)[0]
        lowest = min(logit for _, logit in routes[YAML].values())
        assert routes[YAML][worker][1] == logit == lowest, (n, worker, logit, routes[YAML])
        stored = len(prompt) // BLOCK_SIZE  # the prompt's blocks on the picked worker before the next prompt
        for router in (YAML, FLAGS, DEFAULTS):
            wait_until(lambda r=router, t=tokens, w=worker, s=stored: explained(fleet, r, t)[w][0] == s,
                       f"kvctl {router} indexing prompt {n} on {worker}", timeout=30, procs=fleet.procs)
    assert differs_from_defaults == len(prompts())  # the file's settings are in force on both sides
    applied = fleet.routers[YAML].proc.log.read_text()
    assert "router settings applied over the flags: host_cache_hit_weight=0.5, disk_cache_hit_weight=0.1, " \
           "router_track_prefill_tokens=false" in applied
