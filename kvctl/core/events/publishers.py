"""Who publishes KV events, and whether their messages arrive whole and in order: the one set of sequence
rules for every source (engine ZMQ streams, event taps, the Dynamo event plane).

A publisher numbers its messages from 0 (vLLM's ZMQ publisher per process, a Dynamo envelope per publisher
id: docs/contract.md), so order is judged per publisher, never per worker. `Numbering.observe` says where each
number stands:

- the first one heard is in order whatever it is: a subscriber that joins a running fleet starts mid-stream;
- the last + 1 is next; further on is a gap (the messages in between were lost);
- the same one again is a repeat, skipped and counted (a publisher never sends a number twice; a
  transport may deliver one twice), but where the transport delivers each message once (a ZMQ PUB to
  its SUB: `once`), where it can only be a new incarnation, as below;
- a smaller one is a restart: the publisher started over (a restarted engine counts from 0 again: seq 0
  again after its first batch is one);
- a jump of more than `JUMP_MAX` ahead is no plausible loss but an anomaly (a corrupt or hostile number):
  counted, the message taken, and the position kept. Taking it as the new position would drop everything
  after it as old (one event id of 2^63 once froze a worker) or count 2^64 lost messages.

On a transport that redelivers (JetStream), a step back is a redelivery, a repeat, unless it goes back
to the start of a count (`ORIGIN`) or by more than a redelivery could (`REDELIVERY_MAX`): then it is a
restart. No I/O, no clock: time is passed in.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvctl.core.names import WorkerKey, format_worker

MAX_PUBLISHERS = 4096
"""Publishers remembered at once; past it the one heard from longest ago is forgotten (a fleet's restarts
are new identities, so ids accumulate). A fleet has one per engine process and topic: thousands at most."""

JUMP_MAX = 1 << 32
"""The most messages a gap may have lost: 4 billion is a year of 100 batches a second; anything further is a
jump (an anomaly)."""

ORIGIN = 1
"""Where a count starts over (Dynamo's event ids count from 0 or 1): on a redelivering transport, a step
back to it or below is a restart."""

REDELIVERY_MAX = 1 << 16
"""How far back a redelivery may step, on a transport that redelivers: far more than JetStream can have
unacknowledged (a fetch is 512, a consumer's default max_ack_pending 1000)."""


class Order(StrEnum):
    first = "first"  # never heard from before (or forgotten)
    next = "next"  # sequence = last + 1
    gap = "gap"  # last + 1 < sequence <= last + 1 + JUMP_MAX: messages lost in between
    restart = "restart"  # sequence < last (or = last, delivered once): the publisher started over
    repeat = "repeat"  # sequence = last (or, redelivered, a little below it): skipped
    jump = "jump"  # sequence > last + 1 + JUMP_MAX: an anomaly, taken without moving the position


@dataclass(slots=True)
class Numbering:
    """One publisher's numbering: where it stands, and what `observe` found so far.

    `redelivered`: the transport may deliver a message again after later ones (JetStream), so a small step
    back is a repeat rather than a restart. `once`: it never delivers a message twice (a ZMQ PUB to its SUB),
    so the same number again is a restart rather than a repeat."""

    redelivered: bool = False
    once: bool = False
    last: int | None = None
    messages: int = 0
    gaps: int = 0
    lost: int = 0  # messages missing in the gaps
    restarts: int = 0
    repeats: int = 0
    jumps: int = 0

    def observe(self, sequence: int) -> Order:
        """Judge one message's place, and move the position past it (but for a repeat or a jump)."""
        self.messages += 1
        last = self.last
        if last is None:
            self.last = sequence
            return Order.first
        if (sequence == last and not self.once) or (self.redelivered and ORIGIN < sequence < last
                                                     and last - sequence <= REDELIVERY_MAX):
            self.repeats += 1
            return Order.repeat
        if sequence - last - 1 > JUMP_MAX:
            self.jumps += 1
            return Order.jump
        self.last = sequence
        if sequence <= last:
            self.restarts += 1
            return Order.restart
        if sequence > last + 1:
            self.gaps += 1
            self.lost += sequence - last - 1
            return Order.gap
        return Order.next

    def counts(self) -> dict[str, int]:
        return {"gaps": self.gaps, "lost": self.lost, "restarts": self.restarts, "repeats": self.repeats,
                "jumps": self.jumps}


@dataclass(slots=True)
class Publisher:
    publisher_id: int
    topic: str
    component: str
    endpoint: str
    first_seen: float
    last_seen: float
    sequence: Numbering = field(default_factory=Numbering)
    workers: set[WorkerKey] = field(default_factory=set)  # the workers its messages spoke for

    def as_dict(self, now: float) -> dict[str, Any]:
        return {
            "publisher_id": self.publisher_id, "topic": self.topic, "component": self.component,
            "endpoint": self.endpoint, "last_sequence": self.sequence.last, "messages": self.sequence.messages,
            **self.sequence.counts(), "last_seen_age_s": round(now - self.last_seen, 3),
            "workers": [format_worker(w) for w in sorted(self.workers)],
        }


class PublisherBook:
    """Every publisher heard from (the last `limit`), keyed by its id, the one heard from longest ago first.

    Kept in the order they were last heard from, so forgetting the oldest is O(1): a scan of all of them for each
    new id held a router's loop 40 % of the time under 10,000 new ids a second (issue 36). `now` never goes back
    (a monotonic clock); of publishers last heard at the same instant, the one heard first is forgotten first.
    `evicted` counts the publishers forgotten for want of room: their positions lost, a gap of theirs unseen."""

    def __init__(self, limit: int = MAX_PUBLISHERS) -> None:
        self.limit = limit
        self.publishers: OrderedDict[int, Publisher] = OrderedDict()
        self.evicted = 0
        self.last_evicted: Publisher | None = None

    def observe(self, publisher_id: int, sequence: int, now: float, topic: str, component: str,
                endpoint: str) -> tuple[Order, Publisher]:
        """Judge one envelope's place in its publisher's stream, and remember it."""
        publishers = self.publishers
        pub = publishers.get(publisher_id)
        if pub is None:
            if len(publishers) >= self.limit:
                self.last_evicted = publishers.popitem(last=False)[1]
                self.evicted += 1
            pub = publishers[publisher_id] = Publisher(publisher_id, topic, component, endpoint, now, now)
        else:
            publishers.move_to_end(publisher_id)
        pub.last_seen = now
        return pub.sequence.observe(sequence), pub

    def rows(self, now: float) -> list[dict[str, Any]]:
        return [p.as_dict(now) for p in sorted(self.publishers.values(), key=lambda p: (p.topic, p.publisher_id))]

    def totals(self) -> dict[str, int]:
        totals = {"publishers": len(self.publishers), "gaps": 0, "lost": 0, "restarts": 0, "repeats": 0, "jumps": 0}
        for pub in self.publishers.values():
            for name, n in pub.sequence.counts().items():
                totals[name] += n
        return totals
