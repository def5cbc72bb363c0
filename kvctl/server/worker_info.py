"""A worker a router knows of: where its events come from, what it holds back from the index, and what its model
card says of it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvctl.core.events.model_card import ModelCard
from kvctl.core.names import WorkerKey


@dataclass(slots=True)
class WorkerInfo:
    worker_id: int
    dp_rank: int
    model: str
    endpoint: str | None = None
    replay_endpoint: str | None = None
    topic: str = ""
    last_event_at: float | None = None
    total_blocks: int | None = None  # KV capacity, for the decode busy check against reported usage
    max_num_batched_tokens: int | None = None  # from its model card: the prefill thresholds' unit
    # Events the index refused, by status: a worker whose removals name blocks it never stored
    # (block_not_found) hashes tokens differently from its peers or lost events; doctor names which.
    rejected: Counter[str] = field(default_factory=Counter)
    routes: int = 0  # decisions that chose this worker: its share of the traffic
    # Known only from the state dir: nothing heard from it since this router started. Its blocks may belong to
    # an engine that is gone, or to another configuration's fleet (doctor's `silent` names such workers).
    restored: bool = False
    # From the worker's model card (a discovery-fed plane): aggregated, prefill or decode, and whether it publishes
    # KV events at all (a disaggregated fleet's decode workers do not, by design). None: no card seen.
    role: str | None = None
    publishes_kv_events: bool | None = None

    @property
    def key(self) -> WorkerKey:
        return (self.worker_id, self.dp_rank)

    def take_card(self, card: ModelCard) -> None:
        """What its model card says of it: its role, event publishing, the prefill limits' unit and (unless set
        otherwise) its KV capacity."""
        self.role, self.publishes_kv_events = card.role, card.publishes_kv_events
        if self.total_blocks is None:
            self.total_blocks = card.total_kv_blocks
        self.max_num_batched_tokens = card.max_num_batched_tokens
