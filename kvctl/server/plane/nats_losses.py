"""What `serve --nats` lost to a slow consumer or a lost connection, in the router's ledger (server/health.py), and
which workers' index it left wrong (issue 36): NATS Core keeps nothing for a subscriber that falls behind.

Two things drop the router's messages:

- nats-py, when the subscription's pending queue (`--nats-pending-msgs`, `--nats-pending-bytes`) is full: each
  message dropped is one `SlowConsumerError`, counted at once (`nats`, `slow_consumer`);
- the server, when what it holds for the connection passes its `max_pending` (64 MiB by default) or a write to it
  its `write_deadline`: it closes the connection without a word, and nats-py reconnects. Finding the same server
  again (its server id) tells this from a restart or a fail-over (a new id): `slow_consumer` or `disconnected`.
  How many messages were lost is known only as each publisher sends again: its first message on the new
  connection skips as many sequence numbers (docs/contract.md: Dynamo numbers each publisher's envelopes).

A message received before a drop may still be waiting in nats-py's queue when the drop is noticed, so each drop
marks the position in the stream of messages the router has taken (`mark`); a publisher's messages up to it say
nothing of the drop, the first one after it does. Until each KV-events publisher known at a drop has sent again,
and while any worker has lost KV events (an event id skipped: its index may keep blocks the worker evicted and
miss blocks it stored), the plane is a fault that leaves `/readyz` 200 "partial". A worker is whole again once it
is cleared: its publisher restarted, or `kvctl router reset --worker W` / its removal.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvctl.core.events.plane import KV_EVENTS, PlaneScope
from kvctl.core.events.publishers import Order, Publisher, PublisherBook
from kvctl.core.names import WorkerKey, format_worker
from kvctl.core.words import counted
from kvctl.server.health import Health

log = logging.getLogger("kvctl.serve")

SURFACE = "nats"
PART = "plane.nats.lost"
SLOW_CONSUMER = "slow_consumer"  # nats-py dropped messages, or the server dropped the connection and kept running
DISCONNECTED = "disconnected"  # the connection was lost to a server restart, a fail-over or the network
LOG_EVERY_S = 60.0
"""Client-side drops come in floods: the first is logged, then one line a minute at most, with the count."""
GAPPED_SHOWN = 32
"""Workers named in `/v1/status` (`gapped_workers` says how many in all)."""

Where = tuple[str, str, str]  # (component, endpoint, topic): what a subject names


@dataclass(slots=True)
class _Awaited:
    """A publisher known at a drop, until it sends again after it."""

    where: Where
    lost_before: int  # its `Sequence.lost` then: what it lost since is the drop's
    count: bool  # whether what it lost is counted when it sends again (not when nats-py counted each drop)
    kv: bool  # a KV-events publisher the index takes events from


class NatsLosses:
    """The NATS plane's losses: counted in `health`, its `PART` fault raised and cleared, and shown in status."""

    def __init__(self, health: Health, publishers: PublisherBook, scope: PlaneScope, *, url: str,
                 pending_msgs: int, pending_bytes: int, kv_events: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`kv_events`: the index takes KV events from NATS Core (False: from JetStream, which loses none)."""
        self.health = health
        self.publishers = publishers
        self.scope = scope
        self.url = url
        self.pending_msgs = pending_msgs
        self.pending_bytes = pending_bytes
        self.kv_events = kv_events
        self.clock = clock
        self.taken = 0  # messages the plane took from nats-py, in the order they came
        self.client_drops = 0
        self.server_drops = 0
        self.disconnects = 0
        self.messages_lost = 0
        self.awaited: dict[int, _Awaited] = {}
        self.gapped: dict[WorkerKey, int] = {}  # KV events each worker lost since it was last cleared
        self.server_id: str | None = None
        self._lost_mark = -1  # messages taken when the connection was last lost, and received before
        self._drop_marks: dict[Where, int] = {}  # the same, when nats-py last dropped a message of a subject
        self._waiting: Counter[Where] = Counter()  # awaited publishers, by where they publish
        self._kv_waiting = 0  # awaited KV-events publishers
        self._lost_server: str | None = None  # the server id of the connection lost, until the reconnect
        self._cause = DISCONNECTED
        self._unlogged = 0  # client drops not yet in a log line
        self._logged_at = float("-inf")

    # ----- drops --------------------------------------------------------------------------------------

    def dropped(self, subject: str, pending: int) -> None:
        """nats-py dropped a message of `subject` (a `SlowConsumerError`); `pending`: messages its queue holds.
        Called for each message of a flood: constant work but for the first of a subject."""
        self.client_drops += 1
        self.messages_lost += 1
        self.health.lose(SURFACE, SLOW_CONSUMER, 1, detail=(
            f"nats-py dropped a message of {subject}: the subscription held {counted(pending, 'message')}, its "
            f"limits are {counted(self.pending_msgs, 'message')} and {counted(self.pending_bytes, 'byte')} "
            "(--nats-pending-msgs, --nats-pending-bytes)"), fix=self._fix())
        where = self.scope.match(subject)
        if where is not None:  # its publisher's next message shows the gap, counted here already
            opened = where not in self._drop_marks  # the first drop of the subject since its publishers sent
            self._drop_marks[where] = self.taken + pending
            if opened:
                for pub in list(self.publishers.publishers.values()):
                    if (pub.component, pub.endpoint, pub.topic) == where:
                        self._await(pub, count=False)
                self._judge()
        self._unlogged += 1
        now = self.clock()
        if now - self._logged_at >= LOG_EVERY_S:
            log.warning("event plane: the router fell behind NATS: nats-py dropped %s (the last of %s), its "
                        "subscription full at %s / %s; raise --nats-pending-msgs / --nats-pending-bytes",
                        counted(self._unlogged, "message"), subject, counted(self.pending_msgs, "message"),
                        counted(self.pending_bytes, "byte"))
            self._logged_at, self._unlogged = now, 0

    def disconnected(self, pending: int) -> None:
        """The connection is lost: what is published until the reconnect is lost with it, counted as each
        publisher sends again. `pending`: messages still in nats-py's queue, received before."""
        self.disconnects += 1
        self._lost_server = self.server_id
        self._lost_mark = self.taken + pending
        self._cause = DISCONNECTED  # until the reconnect finds the same server
        for pub in list(self.publishers.publishers.values()):
            self._await(pub, count=True)
        self._judge()

    def connected(self, server_id: str | None) -> None:
        """Connected (or reconnected) to the server with `server_id`."""
        lost, self.server_id = self._lost_server, server_id
        if self.disconnects == 0:
            return
        self._lost_server = None
        if lost is not None and lost == server_id:
            self._cause = SLOW_CONSUMER
            self.server_drops += 1
            log.warning("event plane: the NATS server at %s closed this router's connection and kept running, as it "
                        "drops a slow consumer (it held more for the router than its max_pending, or a write took "
                        "longer than its write_deadline): what was published meanwhile is lost, counted as each "
                        "publisher sends again", self.url)
            self._judge()

    def _await(self, pub: Publisher, *, count: bool) -> None:
        known = self.awaited.get(pub.publisher_id)
        if known is not None:
            known.count = known.count or count
            return
        where = (pub.component, pub.endpoint, pub.topic)
        kv = pub.topic == KV_EVENTS and self.kv_events
        self.awaited[pub.publisher_id] = _Awaited(where, pub.sequence.lost, count, kv)
        self._waiting[where] += 1
        self._kv_waiting += kv

    def _settle(self, publisher_id: int) -> _Awaited:
        awaited = self.awaited.pop(publisher_id)
        self._waiting[awaited.where] -= 1
        if not self._waiting[awaited.where]:
            del self._waiting[awaited.where]
            self._drop_marks.pop(awaited.where, None)
        self._kv_waiting -= awaited.kv
        return awaited

    # ----- what the ingest learns ---------------------------------------------------------------------

    def heard(self, publisher: Publisher, order: Order) -> None:
        """One message of `publisher`, judged `order`: the first after a drop tells what the drop cost it."""
        if order is Order.gap and publisher.topic == KV_EVENTS and self.kv_events:
            for worker in publisher.workers:  # a lost KV message lost some of its workers' events
                self._gap(worker, 0)
        if not self.awaited:
            return
        if order is Order.first:  # a new publisher may have pushed an awaited one out of the book
            for gone in [pid for pid in self.awaited if pid not in self.publishers.publishers]:
                self._settle(gone)
        awaited = self.awaited.get(publisher.publisher_id)
        if awaited is None or self.taken <= max(self._lost_mark, self._drop_marks.get(awaited.where, -1)):
            return  # received before the drop: it says nothing of it
        self._settle(publisher.publisher_id)
        lost = publisher.sequence.lost - awaited.lost_before
        if lost and awaited.count:
            self.messages_lost += lost
            self.health.lose(SURFACE, self._cause, lost, detail=(
                f"publisher {publisher.publisher_id} ({publisher.topic} of {publisher.component}."
                f"{publisher.endpoint}) skipped {counted(lost, 'message')} when it sent again after "
                f"{self._drop_words()}"), fix=self._fix())
        if awaited.kv and not self._kv_waiting:
            self._judge()

    def lost_events(self, worker: WorkerKey, n: int) -> None:
        """`worker`'s event ids skipped `n`: its index is wrong until it is cleared."""
        self._gap(worker, n)

    def cleared(self, worker: WorkerKey) -> None:
        """`worker` holds nothing from before (its publisher restarted, a reset, its removal): whole again, and
        its publishers no longer waited for."""
        was_gapped = self.gapped.pop(worker, None) is not None
        waited = [pid for pid, a in self.awaited.items()
                  if a.kv and worker in getattr(self.publishers.publishers.get(pid), "workers", ())]
        for pid in waited:
            self._settle(pid)
        if was_gapped or waited:
            self._judge()

    def _gap(self, worker: WorkerKey, n: int) -> None:
        known = self.gapped.get(worker)
        self.gapped[worker] = (known or 0) + n
        if known is None:
            self._judge()

    # ----- the fault ----------------------------------------------------------------------------------

    def _judge(self) -> None:
        """Raise, reword or clear the fault. Its reason names no running count: each new wording is an ERROR line."""
        waiting = self._kv_waiting > 0
        if not self.gapped and not waiting:
            self.health.recover(PART)
            return
        parts = []
        if self.gapped:
            others = " and other workers" if len(self.gapped) > 1 else ""
            parts.append(f"worker {format_worker(min(self.gapped))}{others} lost KV events: the index may keep blocks "
                         f"they evicted and miss blocks they stored until they are cleared")
        if waiting:
            parts.append(f"KV events published during {self._drop_words()} are lost, and whose is known only as "
                         f"each publisher sends again")
        self.health.fail(PART, "; ".join(parts), "kvctl router reset --worker W --yes for each worker of kvctl "
                         "router status' gapped workers; against the next drop, see lost:nats")

    def _drop_words(self) -> str:
        if not self.disconnects:
            return "nats-py's drops (a slow consumer)"
        if self._cause == SLOW_CONSUMER:
            return "the NATS server's drop of this router (a slow consumer)"
        return "the lost NATS connection"

    @staticmethod
    def _fix() -> str:
        return ("raise --nats-pending-msgs / --nats-pending-bytes, or the NATS server's max_pending / "
                "write_deadline; follow fewer publishers per router (--component, --endpoint); or take KV events "
                "from --jetstream or Dynamo's ZMQ plane (--dynamo-discovery)")

    # ----- views --------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        gapped = sorted(self.gapped.items())
        return {
            "pending_limits": {"messages": self.pending_msgs, "bytes": self.pending_bytes},
            "client_drops": self.client_drops, "server_drops": self.server_drops, "disconnects": self.disconnects,
            "messages_lost": self.messages_lost, "events_lost": sum(self.gapped.values()),
            "awaiting_publishers": self._kv_waiting, "gapped_workers": len(gapped),
            "gapped": {format_worker(w): n for w, n in gapped[:GAPPED_SHOWN]},
        }
