"""The model cards of the workers a discovery-fed plane follows: each worker is indexed in the model its card
names, its role, whether it publishes KV events and its KV capacity go onto the fleet's workers, and status says
which models and block sizes the cards name, so that doctor can set them against what this router hashes with
(Dynamo's router takes all of it from them)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvctl.core.events.errors import DecodeError
from kvctl.core.events.model_card import ModelCard, parse_model_card
from kvctl.core.names import format_worker
from kvctl.core.words import counted
from kvctl.server.state import Fleet

log = logging.getLogger("kvctl.serve")

MAX_CARDS = 65_536
"""Cards kept at most: one per worker instance, so a fleet far past any real one; the rest are counted."""
MAX_MODELS = 256
"""Models the cards may name (each an index and a router of its own); cards naming more are counted, not kept."""


@dataclass(frozen=True, slots=True)
class CardBlockSizes:
    """Which models take the block size their cards give: every one when no --block-size was given, but those
    given one of their own (`sized_models`, in --config). Called with a model's name."""

    adopt: bool = False
    sized_models: frozenset[str] = frozenset()

    def __call__(self, model: str) -> bool:
        return self.adopt and model not in self.sized_models


class CardBook:
    """The cards of the last listing, by instance id, within the plane's scope (component, endpoint)."""

    def __init__(self, component: str | None, endpoint: str | None) -> None:
        self.scope = (component, endpoint)
        self.cards: dict[int, ModelCard] = {}
        self.errors: Counter[str] = Counter()  # records that are not cards, by kind: counted each listing
        self.over_cap = 0  # cards past MAX_CARDS, or naming a model past MAX_MODELS (their workers: the plane model)

    def read(self, records: Mapping[str, bytes]) -> None:
        """The cards now in the store (every record of the namespace's bucket): those of the scope replace the
        last listing's."""
        cards: dict[int, ModelCard] = {}
        models: set[str] = set()
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
            if len(cards) >= MAX_CARDS or (card.model not in models and len(models) >= MAX_MODELS):
                over += 1
                continue
            cards[card.instance_id] = card
            models.add(card.model)
        self.cards, self.errors, self.over_cap = cards, errors, over

    def apply(self, fleet: Fleet, now: float, adopt_block_size: Callable[[str], bool]) -> None:
        """Each worker into the model its card names, as Dynamo's router keeps one per model (one heard of before
        its card is moved there with its blocks), with its role, event publishing and (unless set otherwise) KV
        capacity. A model `adopt_block_size` says was given no block size takes its cards' when they agree."""
        sizes: dict[str, set[int]] = {}
        for card in self.cards.values():
            sizes.setdefault(card.model, set()).update([] if card.block_size is None else [card.block_size])
        eagle = {card.model for card in self.cards.values() if card.eagle} - {
            card.model for card in self.cards.values() if not card.eagle}
        for model, found in sizes.items():
            size = next(iter(found)) if len(found) == 1 and adopt_block_size(model) else None
            router = fleet.add_model(model, block_size=size).router
            if router.eagle != (model in eagle):
                log.info("event plane: model %r %s", model, "hashes prompts EAGLE-style (B + 1 tokens a block), as its "
                         "model cards say enable_eagle" if model in eagle else "no longer hashes EAGLE-style")
                router.eagle = model in eagle
            if size is not None and router.block_size != size:
                log.info("event plane: model %r hashes %d-token blocks, its model cards' (kv_cache_block_size)",
                         model, size)
                router.block_size = size
        moved = fleet.rehome(self.cards, now)
        if moved:
            log.info("event plane: %s heard of before their model cards moved, with their blocks, to the models "
                     "the cards name: %s", counted(len(moved), "worker rank"),
                     ", ".join(f"{format_worker(w)} to {fleet.workers[w].model!r}" for w in moved[:8]))
        roles: dict[str, Counter[str]] = {}
        for card in self.cards.values():
            roles.setdefault(card.model, Counter())[card.role] += card.dp_size
            for rank in card.ranks:
                info = fleet.workers.get((card.instance_id, rank))
                if info is not None:
                    info.take_card(card)
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
