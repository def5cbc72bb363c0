"""Where a request goes, and why: Dynamo 1.6.1's cost function with a per-candidate explanation (docs/contract.md).

For each candidate (worker, dp_rank), block size B, a prompt of ISL tokens (ceil(ISL/B) = request blocks):

    credit   = overlap_score_credit * decay * device_blocks
               + host_cache_hit_weight * host_blocks + disk_cache_hit_weight * disk_blocks
    decay    = 1 / (1 + overlap_score_credit_decay * ((active_prefill - min active_prefill) / B) / request_blocks)
    raw      = (active_prefill_tokens + ISL) / B
    decode   = active_blocks + the prompt's full blocks not already in flight there
    logit    = prefill_load_scale * max(0, raw - credit) + decode + decode_active_request_weight * requests

`host_blocks` and `disk_blocks` are how far a slower tier continues the worker's match beyond the faster
ones (`IndexMatches.by_tier`); blocks on the external tier, which continues the disk one, count as disk
blocks, as in Dynamo's `disk_extension_blocks`. The minimum is over the candidates. Lowest logit wins;
exact ties are drawn uniformly. With prefill-token tracking off, the prompt adds no prefill (raw counts
in-flight tokens only), there is no decay, and while the overlap credit is positive the logit is
`max(0, decode - credit)` plus the request term. Above temperature 0 the choice is sampled from a
softmax of the logits scaled by their range. A disaggregated fleet is two pools, each with its own config
(`RouterConfig.for_pool`): the prefill pool tracks no active blocks (decode = 0), and the decode pool gives no
overlap credit, tracks no prefill tokens and assumes no KV reuse (decode = active blocks + every full block).
The arithmetic is Dynamo's, in its order, so exact ties are the same ties. Randomness is injected
(`random.Random`), so tests are seeded.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from kvctl.core.events import Tier
from kvctl.core.index import IndexMatches
from kvctl.core.names import Role, WorkerKey
from kvctl.core.router.sequences import Load, LoadView

if TYPE_CHECKING:
    from kvctl.core.router.queue import WouldQueue

CREDITED_TIERS = (Tier.device, Tier.host_pinned, Tier.disk, Tier.external)
"""The tiers the cost function credits; external blocks earn the disk weight (Dynamo counts them as disk)."""

KNOBS = ("overlap_score_credit", "overlap_score_credit_decay", "prefill_load_scale", "decode_active_request_weight",
         "host_cache_hit_weight", "disk_cache_hit_weight", "router_temperature", "track_prefill_tokens")
"""The cost function's knobs by their Dynamo names: flags, config files, policy YAML and requests all use these."""


class Reason(StrEnum):
    only_candidate = "only_candidate"
    lowest_logit = "lowest_logit"
    tie_random = "tie_random"  # several lowest logits: drawn uniformly among them
    sampled = "sampled"  # temperature > 0: drawn from the softmax
    pinned = "pinned"  # the session's pinned worker (session affinity), its cost shown as Dynamo logs it


class NoCandidates(Exception):
    """The model has no registered worker to route to."""


class BadKnob(ValueError):
    """A router knob out of its range; the message names the knob (a request's 4xx says which field)."""


def _check_knob(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value >= 0):
        raise BadKnob(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Dynamo's defaults (KvRouterConfig 1.6.1); every number must be finite and >= 0, as Dynamo checks them."""

    overlap_score_credit: float = 1.0
    overlap_score_credit_decay: float = 0.0
    prefill_load_scale: float = 1.0
    decode_active_request_weight: float = 0.0
    host_cache_hit_weight: float = 0.75
    disk_cache_hit_weight: float = 0.25
    router_temperature: float = 0.0
    track_prefill_tokens: bool = True
    booked_tier_weights: tuple[float, float] | None = None
    """Host and disk weights of the effective overlap a reservation books, when not the two above: Dynamo
    1.6.1 books with its router-wide weights even where a policy file's instance scores with its own."""
    track_active_blocks: bool = True
    """False (a disaggregated fleet's prefill pool): no decode term, and a reservation books no blocks."""
    assume_kv_reuse: bool = True
    """False (the decode pool): a prompt's blocks never share those already in flight on a worker; every one
    counts, and a reservation books them as blocks of its own."""

    def __post_init__(self) -> None:
        for name in KNOBS[:-1]:
            _check_knob(name, getattr(self, name))
        for name in ("track_prefill_tokens", "track_active_blocks", "assume_kv_reuse"):
            if not isinstance(getattr(self, name), bool):
                raise BadKnob(f"{name} must be true or false, got {getattr(self, name)!r}")

    def for_pool(self, role: Role) -> RouterConfig:
        """The config Dynamo 1.6.1's frontend routes a disaggregated fleet's pool with: the prefill router's copy
        tracks no active blocks; each decode pick overrides the overlap credit to 0, assumes no KV reuse and
        books no prefill tokens (so it weighs decode load alone). An aggregated pool routes as configured."""
        if role is Role.prefill:
            return dataclasses.replace(self, track_active_blocks=False)
        if role is Role.decode:
            return dataclasses.replace(self, overlap_score_credit=0.0, assume_kv_reuse=False,
                                       track_prefill_tokens=False)
        return self

    def override(self, *, overlap_score_weight: float | None = None, temperature: float | None = None,
                 **knobs: float | bool | None) -> RouterConfig:
        """This config with the knobs given (None: keep), by Dynamo name or by a legacy alias.

        `overlap_score_weight` is Dynamo's deprecated name for prefill_load_scale and wins over it; 0 also
        sets the overlap credit to 0, as in Dynamo. `temperature` is kvctl's old name for router_temperature."""
        changes = {k: v for k, v in knobs.items() if v is not None}
        unknown = sorted(set(changes) - set(KNOBS))
        if unknown:
            raise TypeError(f"unknown router knob {unknown[0]!r}")
        if temperature is not None:
            _check_knob("temperature (kvctl's old name for router_temperature)", temperature)
            changes.setdefault("router_temperature", temperature)
        if overlap_score_weight is not None:  # named as the caller wrote it: the 4xx must name their field
            _check_knob("overlap_score_weight (Dynamo's old name for prefill_load_scale)", overlap_score_weight)
            changes["prefill_load_scale"] = overlap_score_weight
            if overlap_score_weight == 0:
                changes["overlap_score_credit"] = 0.0
        if not changes:
            return self  # the common case, on every route: a frozen dataclass costs its validation to build
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Candidate:
    """One row of the explanation: every number that went into a candidate's logit."""

    worker: WorkerKey
    overlap_blocks: int
    overlap_by_tier: Mapping[Tier, int]
    credit_by_tier: Mapping[Tier, float]
    decay: float
    effective_overlap: float
    tree_size: int
    raw_prefill_blocks: float
    prefill_blocks: float
    decode_blocks: int
    active_requests: int
    logit: float
    busy: bool = False

    @property
    def credit(self) -> float:
        """The overlap credited across tiers: the sum the cost function weighs."""
        return sum(self.credit_by_tier.values())


@dataclass(slots=True)
class Scores:
    """Every candidate's numbers as columns: cheap to compute for every request, rows only on demand."""

    workers: Sequence[WorkerKey]
    overlap: list[int]
    host: list[int]
    disk: list[int]  # external blocks included
    decay: list[float]
    effective: list[float]
    tree_size: list[int]
    raw_prefill: list[float]
    prefill: list[float]
    decode: list[int]
    requests: list[int]
    logit: list[float]
    busy: list[bool]
    by_tier: Mapping[Tier, Mapping[WorkerKey, int]]
    config: RouterConfig

    def rows(self) -> list[Candidate]:
        by_tier, c = self.by_tier, self.config
        rows = []
        for i, w in enumerate(self.workers):
            dev = self.overlap[i]
            tiers = ({t: n for t, s in by_tier.items() if (n := s.get(w, 0))} if by_tier
                     else ({Tier.device: dev} if dev else {}))
            external = tiers.get(Tier.external, 0)
            credit = {Tier.device: c.overlap_score_credit * self.decay[i] * dev,
                      Tier.host_pinned: c.host_cache_hit_weight * self.host[i],
                      Tier.disk: c.disk_cache_hit_weight * (self.disk[i] - external),
                      Tier.external: c.disk_cache_hit_weight * external}
            rows.append(Candidate(w, dev, tiers, credit, self.decay[i], self.effective[i], self.tree_size[i],
                                  self.raw_prefill[i], self.prefill[i], self.decode[i], self.requests[i],
                                  self.logit[i], self.busy[i]))
        return rows


@dataclass(frozen=True, slots=True)
class Decision:
    """A pick from one pool (`role`). A disaggregated model's decision is its prefill pick, with the decode pick
    made apart in `decode`, as Dynamo's frontend makes both."""

    worker: WorkerKey
    overlap_blocks: int
    effective_overlap: float
    required_blocks: int
    reason: Reason
    scores: Scores
    role: Role = Role.aggregated
    decode: Decision | None = None
    queued: WouldQueue | None = None  # Dynamo's frontend would hold the request in its router queue first

    @property
    def candidates(self) -> list[Candidate]:
        return self.scores.rows()


def booked_prefill_tokens(isl_tokens: int, effective_overlap: float, block_size: int, config: RouterConfig) -> int:
    """Prefill tokens a reservation books: ISL - round(effective overlap * B), tier credit included (Dynamo).

    Rounded half away from zero, as Rust's f64::round; nothing when prefill tokens are not tracked."""
    if not config.track_prefill_tokens:
        return 0
    return max(0, isl_tokens - math.floor(effective_overlap * block_size + 0.5))


def score(
    candidates: Sequence[WorkerKey],
    matches: IndexMatches,
    loads: Mapping[WorkerKey, LoadView],
    new_blocks: Callable[[WorkerKey], int] | int,
    *,
    isl_tokens: int,
    block_size: int,
    config: RouterConfig,
    busy: Mapping[WorkerKey, bool] | None = None,
) -> Scores:
    """Price every candidate, matched or not. `loads` may omit idle workers; `new_blocks(w)` is the
    number of the prompt's full blocks not already among w's in-flight blocks (an int: the same for all)."""
    n = len(candidates)
    get_overlap = matches.scores.get
    overlap = [get_overlap(w, 0) for w in candidates]
    by_tier = matches.by_tier
    host_of, disk_of, external_of = by_tier.get(Tier.host_pinned), by_tier.get(Tier.disk), by_tier.get(Tier.external)
    host = [host_of.get(w, 0) for w in candidates] if host_of else [0] * n
    disk = [disk_of.get(w, 0) for w in candidates] if disk_of else [0] * n
    if external_of:
        disk = [d + external_of.get(w, 0) for d, w in zip(disk, candidates, strict=True)]
    credit_k, scale = config.overlap_score_credit, config.prefill_load_scale
    host_w, disk_w = config.host_cache_hit_weight, config.disk_cache_hit_weight
    booked_host_w, booked_disk_w = config.booked_tier_weights or (host_w, disk_w)
    effective = [dev + booked_host_w * h + booked_disk_w * d for dev, h, d in zip(overlap, host, disk, strict=True)] \
        if by_tier else [float(dev) for dev in overlap]  # no slower tier: the same numbers, cheaper
    if loads:
        decay, raw, prefill, decode, requests, logits = _priced(
            candidates, overlap, host, disk, loads, new_blocks, config, isl_tokens, block_size)
    else:  # nothing in flight anywhere (every route of an idle fleet): the same numbers, a comprehension a column
        decay, requests = [1.0] * n, [0] * n
        decode = [new_blocks] * n if isinstance(new_blocks, int) else [new_blocks(w) for w in candidates]
        r = (isl_tokens if config.track_prefill_tokens else 0) / block_size
        raw = [r] * n
        credit = [credit_k * dev + host_w * h + disk_w * d for dev, h, d in zip(overlap, host, disk, strict=True)] \
            if by_tier else [credit_k * dev for dev in overlap]
        if not config.track_prefill_tokens and credit_k > 0:  # the credit offsets decode, not prefill
            prefill = [0.0] * n
            logits = [max(dec - c, 0.0) for dec, c in zip(decode, credit, strict=True)]
        else:
            prefill = [max(r - c, 0.0) for c in credit]
            logits = [scale * p + dec for p, dec in zip(prefill, decode, strict=True)]
    tree = matches.tree_sizes.get
    return Scores(candidates, overlap, host, disk, decay, effective, [tree(w, 0) for w in candidates], raw, prefill,
                  decode, requests, logits,
                  [bool(busy.get(w)) for w in candidates] if busy else [False] * n, by_tier, config)


def _priced(candidates: Sequence[WorkerKey], overlap: list[int], host: list[int], disk: list[int],
            loads: Mapping[WorkerKey, LoadView], new_blocks: Callable[[WorkerKey], int] | int, config: RouterConfig,
            isl_tokens: int, block_size: int) -> tuple[list[float], list[float], list[float], list[int], list[int],
                                                       list[float]]:
    """`score`'s columns with requests in flight: decay, raw prefill, prefill, decode, requests, logit."""
    idle: LoadView = Load()
    load = [loads.get(w, idle) for w in candidates]
    blocks_of = (lambda _: new_blocks) if isinstance(new_blocks, int) else new_blocks
    credit_k, decay_k, scale = config.overlap_score_credit, config.overlap_score_credit_decay, config.prefill_load_scale
    host_w, disk_w, request_w = config.host_cache_hit_weight, config.disk_cache_hit_weight, \
        config.decode_active_request_weight
    track, track_blocks = config.track_prefill_tokens, config.track_active_blocks
    request_blocks = -(-isl_tokens // block_size)
    decaying = track and decay_k > 0 and request_blocks > 0
    floor = min(x.active_prefill_tokens for x in load) if decaying and load else 0
    prompt_tokens = isl_tokens if track else 0
    decay, raw, prefill, decode, requests, logits = [], [], [], [], [], []
    for i, w in enumerate(candidates):
        x = load[i]
        d = 1.0 / (1.0 + decay_k * ((x.active_prefill_tokens - floor) / block_size / request_blocks)) \
            if decaying else 1.0
        credit = credit_k * d * overlap[i] + host_w * host[i] + disk_w * disk[i]
        dec = (x.active_blocks if track_blocks else 0) + blocks_of(w)
        request_cost = request_w * x.requests
        r = (x.active_prefill_tokens + prompt_tokens) / block_size
        if not track and credit_k > 0:
            p = 0.0
            logit = max(dec - credit, 0.0) + request_cost
        else:
            p = max(r - credit, 0.0)
            logit = scale * p + dec + request_cost
        decay.append(d)
        raw.append(r)
        prefill.append(p)
        decode.append(dec)
        requests.append(x.requests)
        logits.append(logit)
    return decay, raw, prefill, decode, requests, logits


def select(scores: Scores, temperature: float, rng: random.Random) -> tuple[int, Reason]:
    """The index of the chosen candidate, and why."""
    logits = scores.logit
    n = len(logits)
    if not n:
        raise NoCandidates("no candidate workers")
    if n == 1:
        return 0, Reason.only_candidate
    if temperature > 0:
        return _sample(logits, temperature, rng), Reason.sampled
    best = min(logits)
    if logits.count(best) == 1:
        return logits.index(best), Reason.lowest_logit
    return rng.choice([i for i, v in enumerate(logits) if v == best]), Reason.tie_random


def _sample(logits: list[float], temperature: float, rng: random.Random) -> int:
    """Softmax over -(logit - min) / (range * T): scale-free in the logits, uniform when they are all equal."""
    n = len(logits)
    low = min(logits)
    spread = max(logits) - low
    if spread == 0:
        return rng.randrange(n)
    return rng.choices(range(n), weights=[math.exp(-(v - low) / (spread * temperature)) for v in logits])[0]


def decide(scores: Scores, *, isl_tokens: int, block_size: int, temperature: float, rng: random.Random,
           role: Role = Role.aggregated) -> Decision:
    i, reason = select(scores, temperature, rng)
    return Decision(scores.workers[i], scores.overlap[i], scores.effective[i], -(-isl_tokens // block_size), reason,
                    scores, role)
