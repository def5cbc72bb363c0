"""Other routers' in-flight requests (`--replica-sync`), taken in as what they are: input from anyone on the plane.

A peer's booking is held under (its router id, its request id), so its Free or MarkPrefillCompleted reaches that
booking only, never this router's own or another peer's. Peers have caps of their own per model
(`--max-peer-reservations`, `--max-peer-reserved-tokens`, by default as large as the router's own), counted apart
from the router's own caps: its routes are never refused because of what peers booked. An AddRequest must name a
worker of the model that this router knows, and a request id, a prompt and a prefill hint no larger than a route of
its own may have (`--max-request-tokens`); with `--replica-peers`, only the routers named there are heard. Each
refusal is counted in the health ledger (surface `replica_sync`), and the first of each cause logged.

A Dynamo 1.6.1 worker also publishes MarkPrefillCompleted for the requests it runs, with its own id as the router id
(tests/fixtures/dynamo-1.6.1-fleet/zmq-plane), and Dynamo's frontend often sends none of its own after it: such a
report completes the prefill of the peers' bookings of that request on that very worker, as Dynamo's routers take
it, but never of this router's own bookings (completed through its own API).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvctl.core.events.plane import FREE, PREFILL_COMPLETED, ActiveSequenceEvent, AddRequest
from kvctl.core.names import MAX_REQUEST_ID_CHARS, WorkerKey, format_worker
from kvctl.core.router.router import Router
from kvctl.core.router.sequences import ActiveRequest, ActiveSequences
from kvctl.core.words import counted
from kvctl.server.state import Fleet

log = logging.getLogger("kvctl.serve")

SURFACE = "replica_sync"
SHOWN_ID_CHARS = 64
"""Of a refused request's id, what the ledger's detail and the log show."""

_PUBLISHERS = "/v1/status event_plane.publishers, topic active_sequences_events"
_FIXES = {
    "untrusted_router": "if that router is one of yours, add its id to --replica-peers; otherwise find its publisher "
                        f"({_PUBLISHERS})",
    "unknown_worker": "check that the peer router follows the same fleet (--namespace, --component, --endpoint); "
                      "a worker this router has not heard of yet is taken once it publishes",
    "out_of_range": "raise --max-request-tokens if the peers route prompts that long; otherwise the peer is broken "
                    "or hostile (--replica-peers keeps it out)",
    "duplicate": f"a peer publishing each booking twice, or reusing request ids: find its publisher ({_PUBLISHERS})",
    "max_peer_reservations": "raise --max-peer-reservations if the peers really have that many requests in flight "
                             "(each holds memory); --replica-peers keeps unknown routers out",
    "max_peer_reserved_tokens": "raise --max-peer-reserved-tokens if the peers really have that many prompt tokens "
                                "in flight (about 6 bytes each); --replica-peers keeps unknown routers out",
    "not_owner": "a peer freeing or completing requests it did not book, by this router's request ids: find its "
                 f"publisher ({_PUBLISHERS}); --replica-peers keeps it out",
}


@dataclass(frozen=True, slots=True)
class PeerLimits:
    """What `--replica-sync` takes from other routers: whose events (`trusted` router ids; None: anyone's), and how
    much of their bookings it holds per model at most (None: as much as its own caps let it hold of its own)."""

    trusted: frozenset[int] | None = None
    max_reservations: int | None = None
    max_reserved_tokens: int | None = None


class PeerBookings:
    """Peers' bookings, each in the model of the worker it names (`model`: for a worker this router has not heard
    of), each event checked before it touches them."""

    def __init__(self, fleet: Fleet, model: str, limits: PeerLimits) -> None:
        own = fleet.limits
        self.fleet = fleet
        self.model = model
        self.trusted = limits.trusted
        self.tracking: Counter[str] = Counter(checked=0, matched=0)  # peers' ended requests: do their hashes match
        self.max_reservations = own.max_reservations if limits.max_reservations is None else limits.max_reservations
        self.max_reserved_tokens = (own.max_reserved_tokens if limits.max_reserved_tokens is None
                                    else limits.max_reserved_tokens)
        self._logged: set[str] = set()

    def take(self, event: ActiveSequenceEvent, now: float) -> str:
        """Apply one peer's event if it passes; returns what became of it (the name of a counter)."""
        action = event.action
        info = self.fleet.workers.get((event.worker_id, event.dp_rank))
        state = self.fleet.add_model(self.model if info is None else info.model)
        sequences = state.router.sequences
        if action == PREFILL_COMPLETED and event.router_id == event.worker_id:
            worker = (event.worker_id, event.dp_rank)
            for owner in sequences.peer_owners(event.request_id):
                booked = sequences.get(event.request_id, owner)
                if booked is not None and booked.worker == worker:
                    sequences.mark_prefill_completed(event.request_id, owner)
            return "worker_prefill_reports"
        if self.trusted is not None and event.router_id not in self.trusted:
            return self._refuse("untrusted_router", f"router {event.router_id} is not one of --replica-peers "
                                                    f"({_request(event)})")
        if isinstance(action, AddRequest):
            return self._add(event, action, sequences, state.block_size, now)
        freeing = action == FREE
        if freeing and (done := sequences.get(event.request_id, event.router_id)) is not None:
            self._probe(state.router, done)
        if (sequences.free(event.request_id, event.router_id) if freeing
                else sequences.mark_prefill_completed(event.request_id, event.router_id)):
            return "peer_freed" if freeing else "peer_prefill_completed"
        if sequences.get(event.request_id) is not None:
            return self._refuse("not_owner", f"router {event.router_id} sent {action} for {_request(event)}, which "
                                             "this router booked itself: its booking left as it was")
        return "peer_unmatched"  # booked before this router listened, expired, or refused when it came

    def _add(self, event: ActiveSequenceEvent, add: AddRequest, sequences: ActiveSequences, block_size: int,
             now: float) -> str:
        worker = (event.worker_id, event.dp_rank)
        who = f"router {event.router_id}'s {_request(event)}"
        if worker not in self.fleet.workers:
            return self._refuse("unknown_worker", f"{who} is booked on worker {format_worker(worker)}, which this "
                                                  "router has not heard of")
        blocks = add.token_sequence or []
        prompt, hint, limit = len(blocks) * block_size, add.prefill_tokens_hint, self.fleet.limits.max_request_tokens
        if len(event.request_id) > MAX_REQUEST_ID_CHARS:
            return self._refuse("out_of_range", f"{who}: an id of {len(event.request_id)} characters, over "
                                                f"{MAX_REQUEST_ID_CHARS}")
        if prompt > limit or (hint is not None and hint > limit):
            what = f"a prompt of {prompt} tokens" if prompt > limit else f"a prefill hint of {hint} tokens"
            return self._refuse("out_of_range", f"{who}: {what}, over --max-request-tokens {limit}")
        if sequences.get(event.request_id, event.router_id) is not None:
            return self._refuse("duplicate", f"{who} booked twice: the first booking kept")
        if sequences.peer_requests >= self.max_reservations:
            return self._refuse("max_peer_reservations", f"{counted(sequences.peer_requests, 'request')} of other "
                                f"routers in flight on its model already: {who} not booked")
        if (sequences.peer_blocks + len(blocks)) * block_size > self.max_reserved_tokens:
            return self._refuse("max_peer_reserved_tokens", f"{sequences.peer_blocks * block_size} prompt tokens of "
                                f"other routers in flight on its model, and {who} with {prompt} more would "
                                f"pass {self.max_reserved_tokens}")
        prefill = 0 if not add.track_prefill_tokens else prompt if hint is None else hint
        sequences.add(event.request_id, worker, blocks, prefill, now, owner=event.router_id)
        return "peer_booked"

    def _refuse(self, cause: str, detail: str) -> str:
        fix = _FIXES[cause]
        self.fleet.health.lose(SURFACE, cause, detail=detail, fix=fix)
        if cause not in self._logged:  # the first of each cause; a flood is the ledger's to count
            self._logged.add(cause)
            log.warning("replica sync: %s (%s; the next ones are only counted); %s", detail, cause, fix)
        return "peer_refused"

    def status(self) -> dict[str, Any]:
        """What peers have booked, every model together (the caps are per model)."""
        routers = [state.router for state in self.fleet.models.values()]
        return {"trusted": None if self.trusted is None else sorted(self.trusted),
                "max_peer_reservations": self.max_reservations, "max_peer_reserved_tokens": self.max_reserved_tokens,
                "requests": sum(r.sequences.peer_requests for r in routers),
                "reserved_tokens": sum(r.sequences.peer_blocks * r.block_size for r in routers),
                "tracking": None if self.fleet.tracking is not None else dict(self.tracking)}

    def _probe(self, router: Router, done: ActiveRequest) -> None:
        """Whether peers track requests by the hashes this router does, judged on each peer request that ends:
        one tracked by public hashes starts with its first block's local hash, which the index holds once the
        engine stored the block; keyed ones (`keyed-xxh3-v1`) never match. Requests with no prefill (a decode
        pool's, tracked by random hashes) say nothing; with the router's own key, nothing is judged."""
        if router.tracking is None and done.prefill_tokens and done.block_hashes:
            self.tracking["checked"] += 1
            self.tracking["matched"] += bool(router.index.find_matches(done.block_hashes[:1]).scores)


def audit_heard(fleet: Fleet, event: ActiveSequenceEvent, model: str, stale: Callable[[], Mapping[WorkerKey, str]],
                now: float) -> bool:
    """Another router's event, as a plane or a replay (`POST /v1/decisions`) brings it, before any booking of it
    (the loads are then those it was routed under): a routed request (an add that is not a worker's own report) is
    audited. Whether it was."""
    if isinstance(add := event.action, AddRequest) and event.router_id != event.worker_id:
        fleet.audit.peer(event, add, model, stale(), now)
        return True
    return False


def _request(event: ActiveSequenceEvent) -> str:
    shown = event.request_id[:SHOWN_ID_CHARS]
    return f"request {shown!r}" + ("…" if len(event.request_id) > SHOWN_ID_CHARS else "")
