"""The model cards of the workers a discovery-fed plane follows: each worker's role, whether it publishes KV
events and its KV capacity go onto the fleet's workers, and status says which models and block sizes the cards
name, so that doctor can set them against what this router indexes (Dynamo's router takes all of it from them)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import Any

from kvctl.core.events.errors import DecodeError
from kvctl.core.events.model_card import ModelCard, parse_model_card
from kvctl.server.state import Fleet

log = logging.getLogger("kvctl.serve")

MAX_CARDS = 65_536
"""Cards kept at most: one per worker instance, so a fleet far past any real one; the rest are counted."""


class CardBook:
    """The cards of the last listing, by instance id, within the plane's scope (component, endpoint)."""

    def __init__(self, component: str | None, endpoint: str | None) -> None:
        self.scope = (component, endpoint)
        self.cards: dict[int, ModelCard] = {}
        self.errors: Counter[str] = Counter()  # records that are not cards, by kind: counted each listing
        self.over_cap = 0

    def read(self, records: Mapping[str, bytes]) -> None:
        """The cards now in the store (every record of the namespace's bucket): those of the scope replace the
        last listing's."""
        cards: dict[int, ModelCard] = {}
        errors: Counter[str] = Counter()
        over = 0
        for value in records.values():
            try:
                card = parse_model_card(value)
            except DecodeError as exc:
                errors[exc.kind.value] += 1
                continue
            component, endpoint = self.scope
            if component not in (None, card.component) or endpoint not in (None, card.endpoint):
                continue
            if len(cards) >= MAX_CARDS:
                over += 1
                continue
            cards[card.instance_id] = card
        self.cards, self.errors, self.over_cap = cards, errors, over

    def apply(self, fleet: Fleet, model: str | None = None, *, adopt_block_size: bool = False) -> None:
        """Each known worker's role, event publishing and (unless set otherwise) KV capacity, from its card. For the
        plane's `model`, when the cards agree: the model name its keyed tracking hashes are scoped by (the
        frontend's), and with `adopt_block_size` (no block size was given for it) their block size."""
        names = {card.model for card in self.cards.values()}
        if model is not None and len(names) == 1:
            fleet.add_model(model).router.tracking_model = next(iter(names))
        sizes = {card.block_size for card in self.cards.values() if card.block_size is not None}
        adopting = model if adopt_block_size else None
        if adopting is not None and len(sizes) == 1:
            (size,) = sizes
            router = fleet.add_model(adopting).router
            if router.block_size != size:
                log.info("event plane: model %r hashes %d-token blocks, the fleet's model cards' (kv_cache_block_size)",
                         adopting, size)
                router.block_size = size
        roles: dict[str, Counter[str]] = {}
        for card in self.cards.values():
            for rank in card.ranks:
                info = fleet.workers.get((card.instance_id, rank))
                if info is None:
                    continue
                info.role, info.publishes_kv_events = card.role, card.publishes_kv_events
                if info.total_blocks is None:
                    info.total_blocks = card.total_kv_blocks
                info.max_num_batched_tokens = card.max_num_batched_tokens
                roles.setdefault(info.model, Counter())[card.role] += 1
        fleet.disaggregated = {model: counts for model, counts in roles.items()
                               if counts["prefill"] and counts["decode"]}

    def status(self) -> dict[str, Any]:
        """What the cards say per model: block sizes, roles and workers; what could not be read."""
        models: dict[str, dict[str, Any]] = {}
        for card in self.cards.values():
            row = models.setdefault(card.model, {"block_sizes": set(), "roles": Counter(), "workers": 0,
                                                 "silent_by_design": 0})
            row["block_sizes"].add(card.block_size)
            row["roles"][card.role] += card.dp_size
            row["workers"] += card.dp_size
            row["silent_by_design"] += 0 if card.publishes_kv_events else card.dp_size
        return {"cards": len(self.cards), "errors": dict(self.errors), "over_cap": self.over_cap,
                "models": {name: {**row, "block_sizes": sorted(b for b in row["block_sizes"] if b is not None),
                                  "roles": dict(row["roles"])} for name, row in sorted(models.items())}}
