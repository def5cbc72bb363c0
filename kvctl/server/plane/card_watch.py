"""The model cards of a NATS-fed plane (`kvctl serve --nats URL --dynamo-discovery STORE`): NATS carries events and
no cards, so without them a disaggregated fleet's prefill and decode workers would be one pool of model `default`.
This follows the fleet's discovery store for its cards alone, as the ZMQ plane reads them with its channels."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kvctl.core.events.model_card import cards_prefix
from kvctl.errors import DiscoveryError
from kvctl.server.plane.dynamo_discovery import POLL_S, Discovery, follow
from kvctl.server.plane.model_cards import CardBook
from kvctl.server.state import Fleet

log = logging.getLogger("kvctl.serve")

PART = "plane.discovery"


class CardWatch:
    """Lists a namespace's cards each `poll_s` (or on a watch's change), each listing applied to the fleet; a store
    that fails is tried again (`dynamo_discovery.follow`), while the health ledger says what is not seen meanwhile
    (it blocks nothing: the events still come)."""

    def __init__(self, fleet: Fleet, discovery: Discovery, namespace: str, scope: tuple[str | None, str | None],
                 adopts_block_size: Callable[[str], bool], *, poll_s: float = POLL_S) -> None:
        self.fleet = fleet
        self.discovery = discovery
        self.prefix = cards_prefix(namespace)
        self.book = CardBook(*scope)
        self.adopts_block_size = adopts_block_size
        self.poll_s = poll_s
        self.listings = 0
        self.last_error: str | None = None

    async def first(self) -> None:
        """One listing before the plane subscribes, so that the first events already go to their cards' models;
        a store that fails here is left to `run` to try again."""
        try:
            self._apply(await self.discovery.list(self.prefix))
        except DiscoveryError as exc:
            self._failed(exc)

    async def run(self) -> None:
        async def listed(records: dict[str, bytes]) -> None:
            self._apply(records)

        await follow(self.discovery, self.prefix, self.poll_s, listed, self._failed)

    async def close(self) -> None:
        await self.discovery.close()

    def _apply(self, records: dict[str, bytes]) -> None:
        self.book.read(records)
        self.book.apply(self.fleet, time.monotonic(), self.adopts_block_size)
        self.listings += 1
        if self.last_error is not None:
            self.last_error = None
            self.fleet.health.recover(PART)

    def _failed(self, exc: DiscoveryError) -> None:
        self.last_error = str(exc)
        self.fleet.health.fail(PART, f"discovery {self.discovery.url} fails: {exc}; the workers' model cards are not "
                                     "read: new workers go to --nats-model's model, as one pool",
                               f"check that {self.discovery.url} answers from this host (the runbook's "
                               "part:plane.discovery); kvctl keeps trying")

    def status(self) -> dict[str, Any]:
        return {**self.book.status(), "store": self.discovery.url, "listings": self.listings,
                "last_error": self.last_error}
