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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvctl.core.events import Tier
from kvctl.core.index import IndexMatches
from kvctl.core.router.sequences import Load

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


@dataclass(frozen=True, slots=True)
class Decision:
    worker: Worker
    overlap_blocks: int
    required_blocks: int
    reason: Reason
    candidates: list[Candidate] = field(default_factory=list)


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
    loads: Mapping[Worker, Load],
    new_blocks: Mapping[Worker, int],
    *,
    isl_tokens: int,
    block_size: int,
    config: RouterConfig,
    busy: Mapping[Worker, bool] | None = None,
) -> list[Candidate]:
    """The explanation rows of every candidate, matched or not, in candidate order."""
    rows = []
    by_tier = matches.by_tier
    for worker in candidates:
        device = matches.scores.get(worker, 0)
        depths = {tier: scores.get(worker, 0) for tier, scores in by_tier.items()} or {Tier.device: device}
        overlap = effective_overlap(depths, config.tier_credits) if config.tier_credits else float(device)
        load = loads.get(worker) or Load()
        prefill = (load.active_prefill_tokens + max(0.0, isl_tokens - overlap * block_size)) / block_size
        decode = load.active_blocks + new_blocks.get(worker, 0)
        rows.append(Candidate(
            worker=worker,
            overlap_blocks=device,
            overlap_by_tier={t: d for t, d in depths.items() if d},
            effective_overlap=overlap,
            tree_size=matches.tree_sizes.get(worker, 0),
            prefill_blocks=prefill,
            decode_blocks=decode,
            logit=config.overlap_score_weight * prefill + decode,
            busy=bool(busy and busy.get(worker)),
        ))
    return rows


def select(rows: Sequence[Candidate], temperature: float, rng: random.Random) -> tuple[Candidate, Reason]:
    if not rows:
        raise NoCandidates("no candidate workers")
    if len(rows) == 1:
        return rows[0], Reason.only_candidate
    if temperature > 0:
        return _sample(rows, temperature, rng), Reason.sampled
    best = min(r.logit for r in rows)
    lowest = [r for r in rows if r.logit == best]
    if len(lowest) == 1:
        return lowest[0], Reason.lowest_logit
    smallest = min(r.tree_size for r in lowest)
    fewest = [r for r in lowest if r.tree_size == smallest]
    if len(fewest) < len(lowest):
        return (fewest[0] if len(fewest) == 1 else rng.choice(fewest)), Reason.tie_smallest_tree
    return rng.choice(lowest), Reason.tie_random


def _sample(rows: Sequence[Candidate], temperature: float, rng: random.Random) -> Candidate:
    """Softmax over -(logit / range) / T: scale-free in the logits, uniform when they are all equal."""
    logits = [r.logit for r in rows]
    spread = max(logits) - min(logits)
    if spread == 0:
        return rng.choice(rows)
    scaled = [-(v / spread) / temperature for v in logits]
    top = max(scaled)
    weights = [math.exp(s - top) for s in scaled]
    return rng.choices(rows, weights=weights)[0]


def decide(rows: list[Candidate], *, isl_tokens: int, block_size: int, temperature: float,
           rng: random.Random) -> Decision:
    chosen, reason = select(rows, temperature, rng)
    return Decision(chosen.worker, chosen.overlap_blocks, -(-isl_tokens // block_size), reason, rows)
