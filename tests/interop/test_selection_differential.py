"""kvctl's routing against Dynamo 1.6.1's own `SelectionService` (the arbiter, docs/contract.md), in process.

Both sides get the same bytes: every scenario's KV events go out as vLLM 0.33 payloads on a real pyzmq PUB
socket per (worker, dp rank), which the service subscribes to, and kvctl decodes the same payloads with its
engine decoder. Dynamo's numbers are read from its log (stderr): a `pinned_worker` selection logs that
worker's logit (3 decimals, no decay) and effective cached blocks; an unpinned one logs the winner's logit
in full. The knobs go in as Dynamo reads them: DYN_ROUTER_* variables, `router_config_override` per request,
or a `--router-policy-config` YAML (DYN_ROUTER_POLICY_CONFIG); per request, the service honours only
`track_prefill_tokens` (kvctl's per-request knobs are its own API's). Per scenario the test asserts, against kvctl:
- the index: device blocks and host / disk extension blocks per rank (`overlap_scores`);
- every rank's pinned logit (to the log's 3 decimals) and effective cached blocks;
- per worker (`allowed_worker_ids`, so the decay's minimum is over its ranks) and over the whole fleet:
  the winner's logit to 1e-6, and the winner among kvctl's lowest logits; repeated draws find the same
  tied set (ties are uniform in both); above temperature 0, every draw's logit is kvctl's for that rank;
- after reservations, prefill completions and frees: each rank's booked prefill tokens, active blocks and
  active requests (`loads`).
The `decode_pool` scenarios give the service the config kvctl prices a disaggregated fleet's decode pool with
(no overlap credit, no prefill tokens, no KV reuse: booked blocks are never shared).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvctl.core.events.engine import decode_engine_batch
from kvctl.core.events.engine_encode import VLLM, AllBlocksCleared, BlockRemoved, BlockStored, EngineEvent, encode_batch
from kvctl.core.events.types import Tier
from kvctl.core.hashing import local_block_hashes, sequence_hashes
from kvctl.core.names import Role, WorkerKey
from kvctl.core.router.busy import WorkerLoad
from kvctl.core.router.policy_classes import synthetic
from kvctl.core.router.policy_config import PolicyConfigError, parse_policy_config
from kvctl.core.router.queue import RouterQueue, would_queue
from kvctl.core.router.router import Router
from kvctl.core.router.scoring import Decision, RouterConfig
from kvctl.core.tracking_hash import TrackingKey
from tests.core.test_policy_classes import PROFILE
from tests.interop.fleet import REQUIRE_INTEROP
from tests.support import eventually_async

try:
    import dynamo._core as core
except ImportError:  # the oracle extra: under KVCTL_REQUIRE_INTEROP=1 the tier may not skip
    if REQUIRE_INTEROP:
        raise
    pytest.skip("needs the oracle extra (ai-dynamo-runtime==1.6.1)", allow_module_level=True)
pytestmark = pytest.mark.interop

MODEL = "m"
ENV = {"overlap_score_credit": "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT",
       "overlap_score_credit_decay": "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY",
       "prefill_load_scale": "DYN_ROUTER_PREFILL_LOAD_SCALE",
       "overlap_score_weight": "DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT",
       "decode_active_request_weight": "DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT",
       "host_cache_hit_weight": "DYN_ROUTER_HOST_CACHE_HIT_WEIGHT",
       "disk_cache_hit_weight": "DYN_ROUTER_DISK_CACHE_HIT_WEIGHT",
       "router_temperature": "DYN_ROUTER_TEMPERATURE",
       "track_prefill_tokens": "DYN_ROUTER_TRACK_PREFILL_TOKENS"}
"""kvctl knob -> the variable Dynamo's KvRouterConfig reads it from."""

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PINNED = re.compile(r"Selected pinned worker: .*worker_id=(\d+) dp_rank=(\d+), logit: (\S+), "
                     r"effective cached blocks: (\S+) request_id=\"([^\"]*)\"")
_CHOSEN = re.compile(r"Selected worker .*request_id=\"([^\"]*)\" worker_id=(\d+) .*dp_rank=(\d+) logit=(\S+)")


# ----- the scenarios ------------------------------------------------------------------------------------


def tokens(n: int, base: int = 1000) -> list[int]:
    return list(range(base, base + n))


def blocks(prompt: list[int], b: int, first: int, last: int, medium: str = "GPU", *,
           parent: bool = True) -> BlockStored:
    """Blocks [first, last) of `prompt` as one store; engine hash of block i = 7000 + i (per prompt base)."""
    h = [7000 + prompt[0] + i for i in range(first, last)]
    return BlockStored(h, (7000 + prompt[0] + first - 1) if first and parent else None, prompt[first * b:last * b],
                       b, medium=medium, extra=VLLM.plain_stored_extra(len(h)))


def removed(prompt: list[int], first: int, last: int, medium: str = "GPU") -> BlockRemoved:
    return BlockRemoved([7000 + prompt[0] + i for i in range(first, last)], medium=medium,
                        extra=VLLM.plain_removed_extra())


@dataclass
class Scenario:
    name: str
    workers: dict[int, int]  # worker id -> dp ranks
    events: list[tuple[WorkerKey, list[EngineEvent]]]
    prompt: list[int]
    block_size: int = 4
    knobs: dict[str, float | bool] = field(default_factory=dict)  # the service's config (DYN_ROUTER_*)
    # router_config_override of every request. The 1.6.1 service honours only track_prefill_tokens there (its
    # weights and temperature are fixed when it starts), so that is the one knob a scenario overrides.
    override: dict[str, bool] = field(default_factory=dict)
    policy: str | None = None  # --router-policy-config YAML
    reserve: list[tuple[str, list[int], WorkerKey]] = field(default_factory=list)
    prefill_done: list[str] = field(default_factory=list)
    free: list[str] = field(default_factory=list)
    draws: int = 3
    # A disaggregated fleet's pool: kvctl prices it with RouterConfig.for_pool, and the service is given that
    # config. Only the decode pool's: the 1.6.1 service has no worker type and ignores track_active_blocks.
    pool: Role = Role.aggregated
    max_batched: int | None = None  # each worker's max_num_batched_tokens (the queue threshold's unit)


SENTINEL = tokens(64, base=900_000)
MEDIUMS = ("GPU", "CPU", "DISK", "EXTERNAL")
P = tokens(22)  # 5 full blocks of 4 and a partial one
Q = tokens(40, base=5000)
TIERS = [((1, 0), [blocks(P, 4, 0, 1), blocks(P, 4, 0, 3, "CPU"), blocks(P, 4, 0, 5, "DISK")]),
         ((2, 0), [blocks(P, 4, 0, 2)]),
         ((3, 0), [blocks(P, 4, 0, 1), blocks(P, 4, 1, 3, "CPU")])]
LOADED = [("r1", P, (2, 0)), ("r2", Q, (2, 0)), ("r3", P[:12], (3, 0))]
DP = {1: 2, 2: 1, 3: 3}
DP_EVENTS = [((1, 0), [blocks(P, 4, 0, 3)]), ((1, 1), [blocks(P, 4, 0, 1)]),
             ((3, 2), [blocks(P, 4, 0, 2), blocks(P, 4, 2, 4, "CPU")])]
POLICY = """worker_selection:
  aggregated: tuned
  instances:
    - name: tuned
      type: dynamo-default-cost-fn
      parameters: {overlap_score_credit: 0.5, prefill_load_scale: 2, host_cache_hit_weight: 0.6,
                   disk_cache_hit_weight: 0.1, decode_active_request_weight: 0.5, overlap_score_credit_decay: 1.5,
                   shared_cache_multiplier: 0.3}
"""
ROUTER_TIERS = "router:\n  host_cache_hit_weight: 0.5\n  disk_cache_hit_weight: 0.9\n"
"""A `router:` section's tier weights: over the flags' (DYN_ROUTER_*), under an instance's parameters."""

SCENARIOS = [
    Scenario("empty_index_tie", {1: 1, 2: 1, 3: 1}, [], P, draws=24),
    Scenario("device_only", {1: 1, 2: 1}, [((1, 0), [blocks(P, 4, 0, 3)])], P),
    Scenario("device_equal_depth_tie", {1: 1, 2: 1, 3: 1}, [((1, 0), [blocks(P, 4, 0, 2)]),
                                                            ((2, 0), [blocks(P, 4, 0, 2)])], P, draws=24),
    Scenario("tiers_defaults", {1: 1, 2: 1, 3: 1}, TIERS, P),
    Scenario("tiers_host_orphan_parent", {1: 1, 2: 1}, [((1, 0), [blocks(P, 4, 0, 2), blocks(P, 4, 2, 4, "CPU")]),
                                                        ((2, 0), [blocks(P, 4, 2, 4, "CPU")])], P),
    Scenario("tiers_disk_after_host", {1: 1, 2: 1}, [((1, 0), [blocks(P, 4, 0, 1), blocks(P, 4, 1, 2, "CPU"),
                                                                blocks(P, 4, 2, 5, "DISK")]),
                                                     ((2, 0), [blocks(P, 4, 0, 5, "DISK")])], P),
    Scenario("tiers_host_only_from_root", {1: 1, 2: 1}, [((1, 0), [blocks(P, 4, 0, 3, "CPU")])], P),
    Scenario("tiers_removed_host_block", {1: 1, 2: 1}, [((1, 0), [blocks(P, 4, 0, 1), blocks(P, 4, 1, 4, "CPU"),
                                                                   removed(P, 2, 3, "CPU")])], P),
    Scenario("tiers_cleared", {1: 1, 2: 1}, [((1, 0), [blocks(P, 4, 0, 1), blocks(P, 4, 1, 4, "CPU"),
                                                        AllBlocksCleared(), blocks(P, 4, 0, 2)])], P),
    Scenario("tiers_cleared_one_rank", {1: 2, 2: 1}, [((1, 0), [blocks(P, 4, 0, 1), blocks(P, 4, 1, 4, "CPU")]),
                                                      ((1, 1), [blocks(P, 4, 0, 1), blocks(P, 4, 1, 3, "CPU")]),
                                                      ((1, 0), [AllBlocksCleared()])], P),
    Scenario("tiers_external_counts_as_disk", {1: 1, 2: 1, 3: 1, 4: 1}, [
        ((1, 0), [blocks(P, 4, 0, 3, "DISK"), blocks(P, 4, 0, 3, "EXTERNAL"), removed(P, 1, 2, "EXTERNAL")]),
        ((2, 0), [blocks(P, 4, 0, 1), blocks(P, 4, 1, 3, "EXTERNAL")]),
        ((3, 0), [blocks(P, 4, 0, 1), blocks(P, 4, 1, 2, "DISK"), blocks(P, 4, 2, 4, "EXTERNAL")]),
        ((4, 0), [blocks(P, 4, 0, 2, "DISK"), blocks(P, 4, 0, 4, "EXTERNAL")])], P),
    Scenario("tiers_host_weight", {1: 1, 2: 1, 3: 1}, TIERS, P,
             knobs={"host_cache_hit_weight": 0.5, "disk_cache_hit_weight": 0.9}),
    Scenario("tiers_off", {1: 1, 2: 1, 3: 1}, TIERS, P, knobs={"host_cache_hit_weight": 0, "disk_cache_hit_weight": 0}),
    Scenario("credit_half", {1: 1, 2: 1, 3: 1}, TIERS, P, knobs={"overlap_score_credit": 0.5}),
    Scenario("credit_above_one", {1: 1, 2: 1, 3: 1}, TIERS, P, knobs={"overlap_score_credit": 3}),
    Scenario("prefill_scale", {1: 1, 2: 1, 3: 1}, TIERS, P, knobs={"prefill_load_scale": 2.5}),
    Scenario("legacy_weight", {1: 1, 2: 1, 3: 1}, TIERS, P, knobs={"overlap_score_weight": 1.7}),
    Scenario("legacy_weight_zero", {1: 1, 2: 1, 3: 1}, TIERS, P, knobs={"overlap_score_weight": 0}, draws=24),
    Scenario("reserved_load", {1: 1, 2: 1, 3: 1}, TIERS, P, reserve=LOADED),
    Scenario("reserved_prefill_done", {1: 1, 2: 1, 3: 1}, TIERS, P, reserve=LOADED, prefill_done=["r1", "r3"]),
    Scenario("reserved_freed", {1: 1, 2: 1, 3: 1}, TIERS, P, reserve=LOADED, prefill_done=["r3"], free=["r1"]),
    Scenario("reserved_with_tier_credit", {1: 1, 2: 1, 3: 1}, TIERS, P,
             reserve=[("t1", P, (1, 0)), ("t3", P, (3, 0)), ("t3b", P[:9], (3, 0))]),
    Scenario("decay", {1: 1, 2: 1, 3: 1}, TIERS, P, knobs={"overlap_score_credit_decay": 2}, reserve=LOADED),
    Scenario("decay_on_the_winner", {1: 2, 2: 1}, [((1, 0), [blocks(P, 4, 0, 5)])], P,
             knobs={"overlap_score_credit_decay": 2}, reserve=[("small", Q[:4], (1, 0))]),
    Scenario("decay_strong_credit", {1: 1, 2: 1, 3: 1}, TIERS, P,
             knobs={"overlap_score_credit_decay": 7.5, "overlap_score_credit": 2}, reserve=LOADED),
    Scenario("active_request_weight", {1: 1, 2: 1, 3: 1}, TIERS, P, knobs={"decode_active_request_weight": 1.25},
             reserve=LOADED),
    Scenario("no_prefill_tracking", {1: 1, 2: 1, 3: 1}, TIERS, P, knobs={"track_prefill_tokens": False},
             reserve=LOADED),
    Scenario("no_prefill_tracking_no_credit", {1: 1, 2: 1, 3: 1}, TIERS, P,
             knobs={"track_prefill_tokens": False, "overlap_score_credit": 0}, reserve=LOADED, draws=24),
    Scenario("dp_ranks", DP, DP_EVENTS, P),
    Scenario("dp_ranks_loaded", DP, DP_EVENTS, P, reserve=[("d1", P, (1, 0)), ("d2", Q, (3, 1))],
             knobs={"overlap_score_credit_decay": 1}),
    Scenario("dp_ranks_tie", {1: 2, 2: 2}, [], P, draws=40),
    Scenario("partial_block_prompt", {1: 1, 2: 1}, [((1, 0), [blocks(P, 4, 0, 5)])], P[:21],
             reserve=[("p1", P[:19], (1, 0))]),
    Scenario("block_size_16", {1: 1, 2: 1}, [((1, 0), [blocks(Q, 16, 0, 1)]), ((2, 0), [blocks(Q, 16, 0, 2, "CPU")])],
             Q, block_size=16),
    Scenario("weight_beats_scale", {1: 1, 2: 1, 3: 1}, TIERS, P, reserve=LOADED,
             knobs={"overlap_score_weight": 2.0, "prefill_load_scale": 0.5, "overlap_score_credit": 0.25}),
    Scenario("override_no_tracking", {1: 1, 2: 1, 3: 1}, TIERS, P, override={"track_prefill_tokens": False},
             reserve=LOADED),
    Scenario("temperature", {1: 1, 2: 1, 3: 1}, TIERS, P, knobs={"router_temperature": 0.7}, reserve=LOADED,
             draws=12),
    Scenario("temperature_high", {1: 1, 2: 1, 3: 1}, TIERS, P, knobs={"router_temperature": 2.0}, draws=12),
    Scenario("policy_yaml", {1: 1, 2: 1, 3: 1}, TIERS, P, policy=POLICY, reserve=LOADED),
    Scenario("policy_router_tier_weights", {1: 1, 2: 1, 3: 1}, TIERS, P, policy=ROUTER_TIERS,
             knobs={"host_cache_hit_weight": 0.1, "disk_cache_hit_weight": 0.2}),
    Scenario("policy_router_no_prefill_tracking", {1: 1, 2: 1, 3: 1}, TIERS, P, reserve=LOADED,
             policy="router:\n  router_track_prefill_tokens: false\n", knobs={"track_prefill_tokens": True}),
    Scenario("policy_router_under_the_instance", {1: 1, 2: 1, 3: 1}, TIERS, P, policy=ROUTER_TIERS + POLICY,
             reserve=[("t1", P, (1, 0)), ("t3", P, (3, 0))]),
    Scenario("decode_pool", {1: 1, 2: 1, 3: 1}, TIERS, P, pool=Role.decode, draws=24),
    Scenario("decode_pool_loaded", {1: 1, 2: 1, 3: 1}, TIERS, P, pool=Role.decode,
             reserve=[*LOADED, ("r4", P, (2, 0))], free=["r3"], draws=24),
    Scenario("decode_pool_request_weight", {1: 2, 2: 1}, DP_EVENTS[:2], P, pool=Role.decode,
             knobs={"decode_active_request_weight": 2}, reserve=[("d1", Q, (1, 0)), ("d2", P[:8], (1, 1))]),
]
POOL_ENV = {"overlap_score_credit": "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT",
            "track_prefill_tokens": "DYN_ROUTER_TRACK_PREFILL_TOKENS", "assume_kv_reuse": "DYN_ROUTER_ASSUME_KV_REUSE"}
"""What `RouterConfig.for_pool` changes -> the variable the service reads it from."""


# ----- the two sides ------------------------------------------------------------------------------------


class StderrLog:
    """What Dynamo's Rust logger writes to fd 2 (`stderr_log` points fd 2 at a file meanwhile)."""

    def __init__(self, file: Any) -> None:
        self._file = file

    def lines(self) -> list[str]:
        self._file.seek(0)
        return [_ANSI.sub("", line) for line in self._file.read().decode(errors="replace").splitlines()]

    async def find(self, pattern: re.Pattern[str], tag: str, group: int) -> re.Match[str]:
        """The line `pattern` matches for selection `tag` (its request_id), waiting for the logger."""
        deadline = time.monotonic() + 3
        while True:
            for line in self.lines():
                if (m := pattern.search(line)) and m.group(group) == tag:
                    return m
            assert time.monotonic() < deadline, f"no log line for selection {tag}"
            await asyncio.sleep(0.002)


@contextlib.contextmanager
def stderr_log() -> Iterator[StderrLog]:
    with tempfile.TemporaryFile() as file:
        saved = os.dup(2)
        os.dup2(file.fileno(), 2)
        try:
            yield StderrLog(file)
        finally:
            os.dup2(saved, 2)
            os.close(saved)


@contextlib.contextmanager
def dynamo_env(sc: Scenario, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    for knob, value in sc.knobs.items():
        monkeypatch.setenv(ENV[knob], str(value).lower())
    pool = kvctl_config(sc).for_pool(sc.pool)
    for knob, variable in POOL_ENV.items() if sc.pool is not Role.aggregated else ():
        monkeypatch.setenv(variable, str(getattr(pool, knob)).lower())
    if sc.policy is not None:
        path = tmp_path / "policy.yaml"
        path.write_text(sc.policy)
        monkeypatch.setenv("DYN_ROUTER_POLICY_CONFIG", str(path))
    yield


def kvctl_config(sc: Scenario) -> RouterConfig:
    config = RouterConfig().override(**sc.knobs)
    return parse_policy_config(sc.policy).apply(config) if sc.policy else config


class Side:
    """One scenario on both routers: the service, its sockets, and a kvctl Router fed the same payloads."""

    def __init__(self, sc: Scenario, service: Any, log: StderrLog) -> None:
        self.sc, self.service, self.log = sc, service, log
        self.router = Router(block_size=sc.block_size, config=kvctl_config(sc), rng=random.Random(0))
        self.ctx = zmq.Context()
        self.sockets: dict[WorkerKey, zmq.Socket] = {}
        self.candidates = sorted((w, r) for w, n in sc.workers.items() for r in range(n))
        self.draw = 0

    async def start(self) -> None:
        for wid, ranks in self.sc.workers.items():
            endpoints = {}
            for rank in range(ranks):
                sock = self.ctx.socket(zmq.PUB)
                port = sock.bind_to_random_port("tcp://127.0.0.1")
                self.sockets[(wid, rank)] = sock
                endpoints[rank] = f"tcp://127.0.0.1:{port}"
            record = {"worker_id": wid, "model_name": MODEL, "block_size": self.sc.block_size,
                      "endpoint": endpoints[0], "kv_events_endpoints": endpoints,
                      "data_parallel_start_rank": 0, "data_parallel_size": ranks,
                      "max_num_batched_tokens": self.sc.max_batched}
            await self.service.upsert_worker(record)
        await asyncio.sleep(0.25)  # the service's SUB sockets connect (a PUB drops what it sends before)

    def publish(self) -> None:
        """The scenario's batches, then a sentinel on every socket: blocks of `SENTINEL` on each tier."""
        sent = dict.fromkeys(self.sockets, 0)  # each engine counts its own batches from 0
        sentinel = [blocks(SENTINEL, self.sc.block_size, i, i + 1, medium) for i, medium in enumerate(MEDIUMS)]
        for worker, events in [*self.sc.events, *((w, sentinel) for w in self.sockets)]:
            payload = encode_batch(VLLM, 0.0, events, worker[1])
            self.sockets[worker].send_multipart([b"", sent[worker].to_bytes(8, "big"), payload])
            sent[worker] += 1
            batch = decode_engine_batch(payload)
            assert not batch.errors
            for data in batch.events:
                self.router.index.apply_data((worker[0], batch.dp_rank), data)

    def request(self, prompt: list[int], **extra: Any) -> dict[str, Any]:
        body = {"model_name": MODEL, "token_ids": prompt, **extra}
        if self.sc.override:
            body["router_config_override"] = dict(self.sc.override)
        return body

    async def overlaps(self, prompt: list[int]) -> dict[WorkerKey, tuple[int, int, int]]:
        """Dynamo's (device, host extension, disk extension) per rank."""
        answer = await self.service.overlap_scores(self.request(prompt))
        got = {(w["worker_id"], w["dp_rank"]): (w["device_blocks"], w["host_pinned_extension_blocks"],
                                                 w["disk_extension_blocks"]) for w in answer["workers"]}
        return {w: v for w, v in got.items() if any(v)}

    async def landed(self) -> None:
        """Every socket's sentinel is in Dynamo's index on every tier, so every batch before it is too."""
        want = dict.fromkeys(self.candidates, (1, 1, 2))
        deadline = time.monotonic() + 3
        while await self.overlaps(SENTINEL) != want:
            assert time.monotonic() < deadline, "the service did not apply the events"
            await asyncio.sleep(0.01)

    def kvctl_overlaps(self, prompt: list[int]) -> dict[WorkerKey, tuple[int, int, int]]:
        m = self.router.index.find_matches(local_block_hashes(prompt, self.sc.block_size))
        tiers = [m.by_tier.get(t, {}) for t in (Tier.host_pinned, Tier.disk, Tier.external)]
        out = {w: (m.scores.get(w, 0), tiers[0].get(w, 0), tiers[1].get(w, 0) + tiers[2].get(w, 0))
               for w in self.candidates}
        return {w: v for w, v in out.items() if any(v)}

    def local(self) -> list[int]:
        return local_block_hashes(self.sc.prompt, self.sc.block_size)

    async def book(self) -> None:
        for sid, prompt, worker in self.sc.reserve:
            await self.service.select_and_reserve(self.request(prompt, selection_id=sid, pinned_worker={
                "worker_id": worker[0], "dp_rank": worker[1]}))
            self.router.route([worker], token_ids=prompt, request_id=sid, reserve=True, overrides=self.sc.override,
                              role=self.sc.pool)
        for sid in self.sc.prefill_done:
            await self.service.prefill_complete(sid)
            assert self.router.sequences.mark_prefill_completed(sid)
        for sid in self.sc.free:
            await self.service.free_reservation(sid)
            assert self.router.sequences.free(sid)

    def route(self, candidates: list[WorkerKey]) -> Decision:
        """kvctl's own routing path, for the scenario's prompt and pool."""
        return self.router.route(candidates, token_ids=self.sc.prompt, overrides=self.sc.override, role=self.sc.pool)

    def kvctl_scores(self, candidates: list[WorkerKey]) -> tuple[dict[WorkerKey, float], dict[WorkerKey, float]]:
        """kvctl's logits and effective overlaps over `candidates`, priced as its router prices a route."""
        s = self.route(candidates).scores
        return dict(zip(candidates, s.logit, strict=True)), dict(zip(candidates, s.effective, strict=True))

    async def pinned(self, worker: WorkerKey) -> tuple[float, float]:
        tag = self.tag()
        await self.service.select(self.request(self.sc.prompt, selection_id=tag, pinned_worker={
            "worker_id": worker[0], "dp_rank": worker[1]}))
        m = await self.log.find(_PINNED, tag, 5)
        assert (int(m.group(1)), int(m.group(2))) == worker
        return float(m.group(3)), float(m.group(4))

    async def chosen(self, allowed: list[int] | None = None) -> tuple[WorkerKey, float]:
        tag = self.tag()
        extra: dict[str, Any] = {"selection_id": tag}
        if allowed is not None:
            extra["allowed_worker_ids"] = allowed
        await self.service.select(self.request(self.sc.prompt, **extra))
        m = await self.log.find(_CHOSEN, tag, 1)
        return (int(m.group(2)), int(m.group(3))), float(m.group(4))

    def tag(self) -> str:
        self.draw += 1
        return f"s{self.draw}"

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close(0)
        self.ctx.term()


# ----- the tests ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("sc", SCENARIOS, ids=lambda sc: sc.name)
async def test_same_choice_and_logits(sc: Scenario, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with stderr_log() as log:
        with dynamo_env(sc, monkeypatch, tmp_path):
            service = core.SelectionService(indexer_threads=1)
        side = Side(sc, service, log)
        try:
            await side.start()
            side.publish()
            await side.landed()
            assert await side.overlaps(sc.prompt) == side.kvctl_overlaps(sc.prompt)
            await side.book()
            await _compare(side)
        finally:
            service.shutdown()
            side.close()


async def test_the_router_queue_holds_a_selection_exactly_when_kvctl_says_it_would(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`DYN_ROUTER_QUEUE_THRESHOLD` 0.5 and 40 max batched tokens a worker: the service holds a selection while
    each worker has more than 20 prefill tokens booked (strictly), and dispatches it once one has no more; kvctl's
    verdict (`would_queue`) must say so at each step, and its pick be the one the queue dispatched."""
    sc = Scenario("queue", {1: 1, 2: 1}, [], tokens(8, base=9000), max_batched=40)
    queue = synthetic(RouterQueue(0.5)).classes[0]
    monkeypatch.setenv("DYN_ROUTER_QUEUE_THRESHOLD", "0.5")
    with stderr_log() as log:
        service = core.SelectionService(indexer_threads=1)
        side = Side(sc, service, log)
        try:
            await side.start()

            async def book(sid: str, prompt: list[int], worker: WorkerKey) -> None:
                await service.select_and_reserve(side.request(prompt, selection_id=sid, pinned_worker={
                    "worker_id": worker[0], "dp_rank": worker[1]}))
                side.router.route([worker], token_ids=prompt, request_id=sid, reserve=True)

            def verdict() -> bool:
                booked = side.router.sequences
                loads = {w: WorkerLoad(0, booked.load(w).active_prefill_tokens, max_num_batched_tokens=40)
                         for w in side.candidates}
                return would_queue(queue, loads) is not None

            def pending() -> int:
                return int(service.loads(model_name=MODEL)[0]["pending_count"])

            await book("r1", P, (1, 0))  # 22 tokens: over 20
            await book("r2", Q[:20], (2, 0))  # 20: at the limit, not over it
            assert not verdict()
            assert (await service.select(side.request(sc.prompt, selection_id="s1")))["worker_id"] == 2
            assert side.route(side.candidates).worker == (2, 0)
            await book("r3", Q[20:24], (2, 0))  # 24: both over
            assert verdict()
            held = asyncio.ensure_future(service.select(side.request(sc.prompt, selection_id="s2")))
            await eventually_async(pending, "the service queueing the selection", until=lambda n: n == 1)
            assert not held.done()
            await service.prefill_complete("r1")
            assert side.router.sequences.mark_prefill_completed("r1") and not verdict()
            dispatched = await asyncio.wait_for(held, 3)
            assert (dispatched["worker_id"], dispatched["dp_rank"]) == side.route(side.candidates).worker == (1, 0)
        finally:
            service.shutdown()
            side.close()


CLASSES = PROFILE  # two classes by uncached tokens, and an explicit one


async def test_policy_classes_hold_a_selection_exactly_when_kvctl_says_it_would(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A root profile of two classes by uncached prompt tokens (under 32: at most 10 tokens of prefill in flight a
    rank; 32 and over: half of its 40 max batched tokens) and 15 tokens booked on each of two workers. The service
    holds an 8-token prompt (over 10 everywhere) and dispatches a 40-token one (under 20 somewhere) at once; kvctl's
    class and verdict must say the same, and the held one go where kvctl picks once a booking is freed."""
    path = tmp_path / "classes.yaml"
    path.write_text(CLASSES)
    monkeypatch.setenv("DYN_ROUTER_POLICY_CONFIG", str(path))
    root = parse_policy_config(CLASSES).root
    assert root is not None
    sc = Scenario("classes", {1: 1, 2: 1}, [], tokens(8, base=9000), max_batched=40)
    with stderr_log() as log:
        service = core.SelectionService(indexer_threads=1)
        side = Side(sc, service, log)
        try:
            await side.start()

            def verdict(prompt: list[int]) -> tuple[str, bool]:
                held = root.classify(len(prompt))  # nothing cached: every token uncached
                loads = {w: WorkerLoad(0, side.router.sequences.load(w).active_prefill_tokens,
                                       max_num_batched_tokens=40) for w in side.candidates}
                return held.name, would_queue(held, loads) is not None

            for sid, worker, base in (("r1", (1, 0), 1000), ("r2", (2, 0), 2000)):
                prompt = tokens(15, base=base)
                await service.select_and_reserve(side.request(prompt, selection_id=sid, pinned_worker={
                    "worker_id": worker[0], "dp_rank": worker[1]}))
                side.router.route([worker], token_ids=prompt, request_id=sid, reserve=True)
            short, long = sc.prompt, tokens(40, base=6000)
            assert verdict(short) == ("std_cached", True) and verdict(long) == ("std_uncached", False)
            held = asyncio.ensure_future(service.select(side.request(short, selection_id="short")))
            await eventually_async(lambda: int(service.loads(model_name=MODEL)[0]["pending_count"]),
                                   "the service queueing the short prompt", until=lambda n: n == 1)
            admitted = await asyncio.wait_for(service.select(side.request(long, selection_id="long")), 3)
            assert not held.done() and admitted["worker_id"] in (1, 2)
            await service.free_reservation("r1")
            side.router.free("r1")
            assert verdict(short) == ("std_cached", False)
            dispatched = await asyncio.wait_for(held, 3)
            assert (dispatched["worker_id"], dispatched["dp_rank"]) == side.route(side.candidates).worker == (1, 0)
        finally:
            service.shutdown()
            side.close()


async def _compare(side: Side) -> None:
    sc = side.sc
    temperature = side.router.config.override(**sc.override).router_temperature
    loads = {(x["worker_id"], x["dp_rank"]): (x["potential_prefill_tokens"], x["potential_decode_blocks"],
                                              x["active_requests"])
             for x in side.service.loads(model_name=MODEL)[0]["loads"]}
    for w in side.candidates:  # what the reservations booked
        load = side.router.sequences.load(w)
        assert loads.get(w, (0, 0, 0)) == (load.active_prefill_tokens, load.active_blocks, load.requests), w
    for w in side.candidates:  # one rank alone: no decay, as Dynamo's pinned selection
        logit, effective = await side.pinned(w)
        mine, eff = side.kvctl_scores([w])
        assert abs(mine[w] - logit) <= 5e-4 + 1e-9, (w, mine[w], logit)
        assert abs(eff[w] - effective) <= 5e-3 + 1e-9, (w, eff[w], effective)
    groups = [[w for w in side.candidates if w[0] == wid] for wid in sorted(sc.workers)]
    for group in [*groups, side.candidates] if temperature == 0 else [side.candidates]:
        first = side.route(group)
        logits = dict(zip(first.scores.workers, first.scores.logit, strict=True))
        lowest = {w for w, v in logits.items() if v == min(logits.values())}
        allowed = None if group is side.candidates else [group[0][0]]
        draws = sc.draws if group is side.candidates or len(lowest) > 1 else 1
        mine = {first.worker, *(side.route(group).worker for _ in range(draws - 1))}
        seen = set()
        for _ in range(draws):
            worker, logit = await side.chosen(allowed)
            assert abs(logit - logits[worker]) <= 1e-6, (worker, logit, logits)
            seen.add(worker)
        if temperature == 0:  # the same winner, or the same tied set drawn from
            assert seen == mine == lowest, (seen, mine, logits)


POLICY_FILES = {
    "minimal": "worker_selection:\n  aggregated: a\n  instances:\n    - {name: a, type: dynamo-default-cost-fn}\n",
    "every_parameter": POLICY,
    "builtin": "worker_selection:\n  aggregated: default\n",
    "prefill_only": "worker_selection:\n  prefill: a\n  instances:\n    - {name: a, type: dynamo-default-cost-fn}\n",
    "unused_bad_instance": "worker_selection:\n  aggregated: a\n  instances:\n    - {name: a, type: "
                           "dynamo-default-cost-fn}\n    - {name: b, type: x, parameters: {bogus: 1}}\n",
    "int_and_null": "worker_selection:\n  aggregated: a\n  instances:\n    - name: a\n      type: "
                    "dynamo-default-cost-fn\n      parameters: {prefill_load_scale: 2, overlap_score_credit: null}\n",
    "yaml12_exponent": "worker_selection:\n  aggregated: a\n  instances:\n    - name: a\n      type: "
                       "dynamo-default-cost-fn\n      parameters: {prefill_load_scale: 1e3}\n",
    "router_section_only": "router: {}\n",
    "negative": "worker_selection:\n  aggregated: a\n  instances:\n    - name: a\n      type: "
                "dynamo-default-cost-fn\n      parameters: {overlap_score_credit: -1}\n",
    "nan": "worker_selection:\n  aggregated: a\n  instances:\n    - name: a\n      type: "
           "dynamo-default-cost-fn\n      parameters: {router_temperature: .nan}\n",
    "unknown_parameter": "worker_selection:\n  aggregated: a\n  instances:\n    - name: a\n      type: "
                         "dynamo-default-cost-fn\n      parameters: {overlap_score_weight: 1}\n",
    "string_value": "worker_selection:\n  aggregated: a\n  instances:\n    - name: a\n      type: "
                    "dynamo-default-cost-fn\n      parameters: {prefill_load_scale: '1'}\n",
    "yaml11_bool": "worker_selection:\n  aggregated: a\n  instances:\n    - name: a\n      type: "
                   "dynamo-default-cost-fn\n      parameters: {prefill_load_scale: yes}\n",
    "huge": "worker_selection:\n  aggregated: a\n  instances:\n    - name: a\n      type: "
            "dynamo-default-cost-fn\n      parameters: {prefill_load_scale: 1e400}\n",
    "unknown_type": "worker_selection:\n  aggregated: a\n  instances:\n    - {name: a, type: other}\n",
    "reserved_name": "worker_selection:\n  aggregated: default\n  instances:\n    - {name: default, type: x}\n",
    "bad_name": "worker_selection:\n  aggregated: 'a b'\n  instances:\n    - {name: 'a b', type: x}\n",
    "duplicate": "worker_selection:\n  aggregated: a\n  instances:\n    - {name: a, type: x}\n    - {name: a, "
                 "type: x}\n",
    "missing_instance": "worker_selection:\n  aggregated: b\n  instances:\n    - {name: a, type: x}\n",
    "parameters_list": "worker_selection:\n  aggregated: a\n  instances:\n    - {name: a, type: x, parameters: [1]}\n",
    "no_type": "worker_selection:\n  aggregated: a\n  instances:\n    - {name: a}\n",
    "unknown_key": "worker_selection:\n  aggregated: a\n  colour: red\n",
    "unknown_section": "queue: {}\n",
    "classes": CLASSES,
    "classes_quantum_zero": CLASSES.replace("quantum: 8", "quantum: 0"),
    "classes_lcfs": CLASSES.replace("queue_policy: wspt", "queue_policy: lcfs"),
    "classes_negative_frac": CLASSES.replace("frac: 0.5", "frac: -1"),
    "classes_unknown_bucket": CLASSES.replace("cache_bucket: uncached,", "cache_bucket: nope,"),
    "classes_half_bound": CLASSES.replace("{name: vip,", "{name: vip, policy_family: standard,"),
    "classes_bucket_start": CLASSES.replace("{min_tokens: 0,", "{min_tokens: 1,"),
    "classes_bucket_order": CLASSES.replace("min_tokens: 32", "min_tokens: 0"),
    "classes_unknown_default": CLASSES.replace("default_policy_family: standard", "default_policy_family: x"),
    "classes_collision": CLASSES.replace("{name: vip,", "{name: standard,"),
    "classes_duplicate_binding": CLASSES.replace("cache_bucket: uncached,", "cache_bucket: cached,"),
    "classes_duplicate_name": CLASSES.replace("name: std_uncached", "name: std_cached"),
    "classes_no_quantum": CLASSES.replace("quantum: 8,", ""),
    "classes_partial_root": "default_policy_family: standard\n",
    "classes_model_missing_field": "models:\n  m: {default_policy_family: f}\n",
    "empty": "",
    "empty_selection": "worker_selection: {}\n",
}


@pytest.mark.parametrize("name", POLICY_FILES)
def test_policy_files_accepted_and_refused_as_dynamo_does(name: str, monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY_FILES[name])
    monkeypatch.setenv("DYN_ROUTER_POLICY_CONFIG", str(path))
    try:
        core.SelectionService(indexer_threads=1).shutdown()
        dynamo_error = None
    except Exception as exc:  # noqa: BLE001 - the service raises a bare Exception for policy errors
        dynamo_error = str(exc)
    try:
        parse_policy_config(POLICY_FILES[name])
        kvctl_error = None
    except PolicyConfigError as exc:
        kvctl_error = str(exc)
    assert (kvctl_error is None) == (dynamo_error is None), (kvctl_error, dynamo_error)
    if dynamo_error is not None and "must" in dynamo_error:  # the same reason, in the same words
        assert kvctl_error is not None and dynamo_error.endswith(kvctl_error.split(": ")[-1])


def test_a_policy_type_kvctl_does_not_implement_is_refused_by_name(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    """Dynamo runs its two-tier cost function; kvctl has only the default one and says so (a known difference)."""
    text = "worker_selection:\n  aggregated: a\n  instances:\n    - {name: a, type: dynamo-two-tier-cost-fn}\n"
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    monkeypatch.setenv("DYN_ROUTER_POLICY_CONFIG", str(path))
    core.SelectionService(indexer_threads=1).shutdown()
    with pytest.raises(PolicyConfigError, match="kvctl implements only dynamo-default-cost-fn"):
        parse_policy_config(text)


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "public"])
async def test_in_flight_requests_are_tracked_by_the_hashes_dynamo_books(keyed: bool, monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    """`DYN_ROUTER_TRACKING_HASH=keyed-xxh3-v1`: the service books a request by keyed sequence hashes, as its
    replica-sync message shows; kvctl given the same key books the same ones (public: the public ones)."""
    key = TrackingKey(bytes(range(32)), "2026-12")
    if keyed:
        (tmp_path / "key").write_bytes(key.key)
        monkeypatch.setenv("DYN_ROUTER_TRACKING_HASH", "keyed-xxh3-v1")
        monkeypatch.setenv("DYN_ROUTER_TRACKING_KEY_FILE", str(tmp_path / "key"))
        monkeypatch.setenv("DYN_ROUTER_TRACKING_KEY_ID", key.key_id)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sc = Scenario("tracking", {1: 1}, [], P)
    with stderr_log() as log:
        service = core.SelectionService(indexer_threads=1, replica_sync_port=port)
        side = Side(sc, service, log)
        sub = side.ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"tcp://127.0.0.1:{port}")
            await side.start()  # its wait lets the SUB connect too
            await service.select_and_reserve(side.request(P, selection_id="r1", pinned_worker={"worker_id": 1,
                                                                                              "dp_rank": 0}))
            assert sub.poll(3000), "no replica-sync message from the service"
            booked = msgspec.msgpack.decode(sub.recv_multipart()[-1])["event"]["data"]["AddRequest"]["token_sequence"]
            router = Router(block_size=sc.block_size, tracking=key if keyed else None, tracking_model=MODEL)
            router.route([(1, 0)], token_ids=P, request_id="r1", reserve=True)
            [mine] = router.sequences.requests()
            assert booked == list(mine.block_hashes)
            assert (booked == sequence_hashes(local_block_hashes(P, sc.block_size))) is not keyed
        finally:
            sub.close(0)
            service.shutdown()
            side.close()
