"""Where a request goes, and why: Dynamo's cost function with a per-candidate explanation (DESIGN §3.4).

For each candidate (worker, dp_rank), with block size B and a prompt of ISL tokens:

    prefill_blocks = (active_prefill_tokens + max(0, ISL - overlap * B)) / B
    decode_blocks  = active_blocks + new_prompt_blocks
    logit          = overlap_score_weight * prefill_blocks + decode_blocks      (lowest wins)

`overlap` is the device-tier matched depth, plus optional credits for blocks a worker could onboard
from a slower tier instead of recomputing. At temperature 0 a tie goes to the smallest tree size
(0 when unmatched), then uniformly at random; above 0 the choice is sampled from a softmax of the
logits scaled by their range. Randomness is injected (`random.Random`), so tests are seeded.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from kvctl.core.events import Tier
from kvctl.core.index import IndexMatches
from kvctl.core.router.sequences import Load, LoadView

Worker = tuple[int, int]

DEFAULT_TIER_CREDITS: Mapping[Tier, float] = {Tier.host_pinned: 0.75, Tier.disk: 0.25}
"""Worth of a block onboarded from host memory or disk, in device blocks, when credits are enabled."""


class Reason(StrEnum):
    only_candidate = "only_candidate"
    lowest_logit = "lowest_logit"
    tie_smallest_tree = "tie_smallest_tree"  # several lowest logits; the fewest cached blocks won
    tie_random = "tie_random"  # several lowest logits and tree sizes; drawn uniformly
    sampled = "sampled"  # temperature > 0: drawn from the softmax


class NoCandidates(Exception):
    """The model has no registered worker to route to."""


@dataclass(frozen=True, slots=True)
class RouterConfig:
    overlap_score_weight: float = 1.0
    temperature: float = 0.0
    tier_credits: Mapping[Tier, float] | None = None  # None: device overlap only, as Dynamo

    def __post_init__(self) -> None:
        if not (math.isfinite(self.overlap_score_weight) and self.overlap_score_weight >= 0):
            raise ValueError(f"overlap_score_weight must be a finite number >= 0, got {self.overlap_score_weight}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        for tier, credit in (self.tier_credits or {}).items():
            if tier is Tier.device or not 0 <= credit <= 1:
                raise ValueError(f"tier credit for {tier} must be in [0, 1] and not for the device tier")

    def override(self, *, overlap_score_weight: float | None = None, temperature: float | None = None) -> RouterConfig:
        """This config with a request's own weight / temperature where given."""
        if overlap_score_weight is None and temperature is None:
            return self  # the common case, on every route: a frozen dataclass costs its validation to build
        return RouterConfig(
            self.overlap_score_weight if overlap_score_weight is None else overlap_score_weight,
            self.temperature if temperature is None else temperature,
            self.tier_credits,
        )


@dataclass(frozen=True, slots=True)
class Candidate:
    """One row of the explanation: every number that went into a candidate's logit."""

    worker: Worker
    overlap_blocks: int
    overlap_by_tier: Mapping[Tier, int]
    effective_overlap: float
    tree_size: int
    prefill_blocks: float
    decode_blocks: int
    logit: float
    busy: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker[0],
            "dp_rank": self.worker[1],
            "overlap_blocks": self.overlap_blocks,
            "overlap_by_tier": {tier.value: self.overlap_by_tier.get(tier, 0) for tier in Tier},
            "effective_overlap": self.effective_overlap,
            "tree_size": self.tree_size,
            "prefill_blocks": self.prefill_blocks,
            "decode_blocks": self.decode_blocks,
            "logit": self.logit,
            "busy": self.busy,
        }


@dataclass(slots=True)
class Scores:
    """Every candidate's numbers as columns: cheap to compute for every request, rows only on demand."""

    workers: Sequence[Worker]
    overlap: list[int]
    effective: list[float]
    tree_size: list[int]
    prefill: list[float]
    decode: list[int]
    logit: list[float]
    busy: list[bool]
    by_tier: Mapping[Tier, Mapping[Worker, int]]

    def rows(self) -> list[Candidate]:
        by_tier = self.by_tier
        return [
            Candidate(w, dev, {t: d for t, s in by_tier.items() if (d := s.get(w, 0))} if by_tier
                      else ({Tier.device: dev} if dev else {}), eff, tree, pre, dec, logit, busy)
            for w, dev, eff, tree, pre, dec, logit, busy in zip(
                self.workers, self.overlap, self.effective, self.tree_size, self.prefill, self.decode,
                self.logit, self.busy, strict=True)
        ]


@dataclass(frozen=True, slots=True)
class Decision:
    worker: Worker
    overlap_blocks: int
    required_blocks: int
    reason: Reason
    scores: Scores

    @property
    def candidates(self) -> list[Candidate]:
        return self.scores.rows()


def effective_overlap(depth_by_tier: Mapping[Tier, int], credits: Mapping[Tier, float] | None) -> float:
    """Device depth, plus credited blocks that extend the prefix from slower tiers, fastest tier first."""
    reach = depth_by_tier.get(Tier.device, 0)
    total = float(reach)
    for tier, credit in sorted((credits or {}).items(), key=lambda tc: -tc[1]):
        depth = depth_by_tier.get(tier, 0)
        if depth > reach:
            total += credit * (depth - reach)
            reach = depth
    return total


def score(
    candidates: Sequence[Worker],
    matches: IndexMatches,
    loads: Mapping[Worker, LoadView],
    new_blocks: Callable[[Worker], int] | int,
    *,
    isl_tokens: int,
    block_size: int,
    config: RouterConfig,
    busy: Mapping[Worker, bool] | None = None,
) -> Scores:
    """Price every candidate, matched or not. `loads` may omit idle workers; `new_blocks(w)` is the
    number of the prompt's blocks not already among w's in-flight blocks (an int: the same for all).

    This runs on every route, for every candidate: with nothing in flight anywhere (no loads), each
    column is one comprehension instead of a loop over workers and their loads."""
    get_overlap = matches.scores.get
    overlap = [get_overlap(w, 0) for w in candidates]
    by_tier = matches.by_tier
    if config.tier_credits and by_tier:
        credits = config.tier_credits
        effective = [effective_overlap({t: s.get(w, 0) for t, s in by_tier.items()}, credits) for w in candidates]
    else:
        effective = [float(d) for d in overlap]
    weight = config.overlap_score_weight
    if loads:
        blocks_of = (lambda _: new_blocks) if isinstance(new_blocks, int) else new_blocks
        idle: LoadView = Load()
        prefill: list[float] = []
        decode: list[int] = []
        logits: list[float] = []
        for w, eff in zip(candidates, effective, strict=True):
            load = loads.get(w, idle)
            uncached = isl_tokens - eff * block_size
            p = (load.active_prefill_tokens + (uncached if uncached > 0 else 0.0)) / block_size
            d = load.active_blocks + blocks_of(w)
            prefill.append(p)
            decode.append(d)
            logits.append(weight * p + d)
    else:  # the same numbers, with every load 0
        prefill = [(isl_tokens - e * block_size) / block_size if isl_tokens > e * block_size else 0.0
                   for e in effective]
        decode = ([new_blocks] * len(candidates) if isinstance(new_blocks, int)
                  else [new_blocks(w) for w in candidates])
        logits = [weight * p + d for p, d in zip(prefill, decode, strict=True)]
    tree = matches.tree_sizes.get
    return Scores(candidates, overlap, effective, [tree(w, 0) for w in candidates], prefill, decode, logits,
                  [bool(busy.get(w)) for w in candidates] if busy else [False] * len(candidates), by_tier)


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
    lowest = [i for i, v in enumerate(logits) if v == best]
    sizes = scores.tree_size
    smallest = min(sizes[i] for i in lowest)
    fewest = [i for i in lowest if sizes[i] == smallest]
    if len(fewest) < len(lowest):
        return (fewest[0] if len(fewest) == 1 else rng.choice(fewest)), Reason.tie_smallest_tree
    return rng.choice(lowest), Reason.tie_random


def _sample(logits: list[float], temperature: float, rng: random.Random) -> int:
    """Softmax over -(logit / range) / T: scale-free in the logits, uniform when they are all equal."""
    n = len(logits)
    spread = max(logits) - min(logits)
    if spread == 0:
        return rng.randrange(n)
    scaled = [-(v / spread) / temperature for v in logits]
    top = max(scaled)
    return rng.choices(range(n), weights=[math.exp(x - top) for x in scaled])[0]


def decide(scores: Scores, *, isl_tokens: int, block_size: int, temperature: float, rng: random.Random) -> Decision:
    i, reason = select(scores, temperature, rng)
    return Decision(scores.workers[i], scores.overlap[i], -(-isl_tokens // block_size), reason, scores)
