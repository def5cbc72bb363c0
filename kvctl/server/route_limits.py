"""What a route, which needs no token, may make a router hold: `kvctl serve --max-*`, and the refusal past it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouteLimits:
    """Caps on what a route, which needs no token, can make the router hold (`kvctl serve --max-*`).

    A reserved request keeps its prompt's block hashes until it is freed or expires: ~100 bytes a
    block, so 150 reservations of 1M tokens held 870 MB. The defaults leave room for a 1M-token prompt
    and for a thousand requests of 32k tokens in flight per model, and hold reservations to ~200 MB.
    """

    max_request_tokens: int = 1 << 20  # prompt tokens of one route request
    max_reservations: int = 100_000  # requests in flight, per model
    max_reserved_tokens: int = 1 << 25  # prompt tokens of the requests in flight, per model


class OverLimit(Exception):
    """A route refused by a `RouteLimits` cap (HTTP 429): `limit` names it, `flag` sets it."""

    def __init__(self, limit: str, message: str) -> None:
        self.limit = limit
        self.flag = "--" + limit.replace("_", "-")
        super().__init__(f"{message}; the limit is {self.flag}")
