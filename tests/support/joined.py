"""Wait until ZMQ subscribers have joined a mock engine's PUB, instead of sleeping for ZMQ's "slow joiner".

A SUB's subscription reaches the PUB some time after `connect()`; what the engine publishes before that is
not delivered to it. The mock engine's PUB hears subscriptions (`Publisher.subscriptions()`), so a test
waits for exactly that.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvctl.mock.engine import MockEngine
from tests.support.eventually import eventually_async


def _subscriptions(engine: MockEngine) -> int:
    assert engine.publisher is not None, "the engine is not started"
    return engine.publisher.subscriptions()


async def joined(engines: Iterable[MockEngine], *, at_least: int = 1, timeout: float = 10.0) -> None:
    """Until `at_least` subscriptions have reached the PUB of each of `engines`."""
    engines = list(engines)
    await eventually_async(lambda: [_subscriptions(e) for e in engines],
                           f"{at_least} subscription(s) on each engine's PUB",
                           until=lambda counts: min(counts, default=at_least) >= at_least, timeout=timeout)
