"""A round trip that proves the NATS server has processed every command this connection sent before it.

nats-py's `flush()` writes its PING straight to the socket, ahead of SUB and PUB commands still queued
for its flusher task, so its PONG can come back before the server has seen them (nats-py 2.16). A router
that calls itself ready after `flush()` then misses what peers publish in the next few milliseconds,
and a publisher that "flushed" has not delivered. A message to our own inbox goes through the same
queue as everything before it, so receiving it is the proof `flush()` was meant to be.
"""

from __future__ import annotations

import nats


async def barrier(nc: nats.NATS, timeout: float = 10.0) -> None:
    """Return once the server has processed every SUB and PUB queued on `nc` before this call.

    Raises nats.errors.TimeoutError when the round trip takes longer than `timeout` seconds.
    """
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, max_msgs=1)
    await nc.publish(inbox, b"")
    await sub.next_msg(timeout)
