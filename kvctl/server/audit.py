"""The decision audit's server side: each decision heard is judged against the index at that moment
(`core.audit.judge`) and kept (`core.audit.AuditLedger`) for `/v1/audit`, `/metrics` and `doctor`.

Two kinds are heard: a Dynamo frontend's, from the `AddRequest` its replica sync publishes for every request it
routes (its blocks as sequence hashes, its pick, its own prefill estimate), and kvctl's own `/v1/route` picks.
A frontend's is judged before any replica-sync booking of it, so the loads are those it was routed under.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from kvctl.core.audit.ledger import AuditLedger
from kvctl.core.audit.verdict import Seen, Verdict, judge
from kvctl.core.events.plane import ActiveSequenceEvent, AddRequest
from kvctl.core.names import MAX_REQUEST_ID_CHARS, Role, WorkerKey
from kvctl.core.router.scoring import Decision
from kvctl.server.budget import Slices

if TYPE_CHECKING:
    from kvctl.server.state import Fleet

KVCTL = "kvctl"
"""The router label of kvctl's own decisions."""
BLIND_EVIDENCE = 3
"""Picks holding cache that a router credited with none, with no pick ever credited, before it is judged blind to the
cache: a router with overlap credit 0 takes no KV events (Dynamo 1.6.1), so its estimates never credit any."""
MAX_ROUTERS_TRACKED = 64
JOIN_GRACE_S = 30.0
"""How long a decision for a worker kvctl has not heard of waits for it to register: a restarted engine is routed
to as soon as the frontend sees it, which may be before kvctl does. Registered in time, its decisions are
`index_behind` (kvctl's view was behind); not, they are `unknown_worker`. For as long again after a worker joins
mid-load, its cache and loads may not be whole in kvctl's view: decisions to it short of the most cache are
`index_behind` too."""
MAX_PENDING = 1_000
DRAIN_STEP = 8
"""kvctl's own decisions judged at once on the loop's next turn after a route (~25 us each): a burst of routes in one
turn is judged a few at a time between the next ones."""
OWN_WAITING = 4_096
"""kvctl's own decisions waiting to be judged, at most: a route does not wait for its own audit. The daemon judges
them on the loop's next turn (`soon`): held until a housekeeping tick instead, a second of decisions kept every
route's objects alive, and the young collections they caused held 4 % of routes by ~0.4 ms (route p99 1.3-1.7x).
Without a loop (tests, benchmarks) they wait for `drain`, `flush` or a read of the audit."""


class Auditor:
    def __init__(self, fleet: Fleet, ledger: AuditLedger | None = None) -> None:
        self.fleet = fleet
        self._ledger = ledger or AuditLedger()
        self._own: deque[tuple[str, Decision, str | None, int, float]] = deque()
        self._unnamed = itertools.count(1)
        self._credit_seen: dict[int, list[int]] = {}  # router id -> [picks credited with cache, cached picks not]
        self._pending: deque[Seen] = deque()  # decisions for a worker not registered yet, oldest first
        self._joined: dict[WorkerKey, float] = {}  # workers that registered after decisions were heard: when
        self._heard_at: float | None = None  # the last decision heard from another router
        # Runs a callable on the loop's next turn (the daemon's `loop.call_soon`): judges kvctl's own decisions then
        self.soon: Callable[[Callable[[], None]], object] | None = None

    @property
    def ledger(self) -> AuditLedger:
        """The verdicts, kvctl's own decisions waiting to be judged included."""
        self.flush()
        return self._ledger

    @ledger.setter
    def ledger(self, ledger: AuditLedger) -> None:
        self._ledger = ledger

    def own(self, model: str, decision: Decision, request_id: str | None, isl_tokens: int, now: float) -> None:
        """One of kvctl's own picks, judged with the scores it was made with, later (`flush`)."""
        own = self._own
        own.append((model, decision, request_id, isl_tokens, now))
        if len(own) == 1 and self.soon is not None:
            self.soon(self._judge_soon)
        elif len(own) >= OWN_WAITING:
            self.flush()

    def _judge_soon(self) -> None:
        self.flush(DRAIN_STEP)
        if self._own and self.soon is not None:
            self.soon(self._judge_soon)

    async def drain(self) -> None:
        """Judge kvctl's own waiting decisions, letting the loop run between slices (the daemon's housekeeping)."""
        slices = Slices()
        while self._own:
            await slices.tick()
            self.flush(DRAIN_STEP)

    def flush(self, most: int | None = None) -> None:
        """Judge kvctl's own decisions that wait (the `most` oldest), in the order they were made."""
        own, models = self._own, self.fleet.models
        for _ in range(len(own) if most is None else min(most, len(own))):
            model, decision, request_id, isl_tokens, at = own.popleft()
            if (state := models.get(model)) is None:
                continue  # the model went (a test's fleet): nothing to judge against
            router = state.router
            config = router.config.for_pool(decision.role)
            seen = Seen(request_id or f"{KVCTL}-{next(self._unnamed)}", model, KVCTL, at, decision.worker,
                        decision.required_blocks, router.block_size, decision.role, decision.required_blocks,
                        credit=config.overlap_score_credit, temperature=config.router_temperature,
                        approximate=router.approx is not None)
            self._ledger.add(judge(seen, decision.scores), decision.scores, isl_tokens)

    def peer(self, event: ActiveSequenceEvent, add: AddRequest, model: str, stale: Mapping[WorkerKey, str],
             now: float) -> Verdict | None:
        """A Dynamo frontend's pick, from its replica sync; `model`: the plane's, for a worker not registered. None
        when the pick is a worker kvctl has not heard of yet: judged once it registers, or the grace is over."""
        fleet = self.fleet
        chosen = (event.worker_id, event.dp_rank)
        info = fleet.workers.get(chosen)
        if info is not None:
            model = info.model
        state = fleet.models.get(model)
        blocks = add.token_sequence or []
        pools = fleet.pools(model) if state else {}
        role = next((r for r, pool in pools.items() if chosen in pool), None)
        block_size = state.block_size if state else fleet.default_block_size
        config = (state.router.config if state else fleet.default_config).for_pool(role or Role.aggregated)
        credited = self._credit_seen.get(event.router_id)
        self._heard_at = now
        if (joined := self._joined.get(chosen)) is not None and now - joined < JOIN_GRACE_S:
            stale = {**stale, chosen: f"joined {now - joined:.0f} s before, mid-load: its cache and loads may not "
                                      "be whole in kvctl's view yet"}
        request_id, over = event.request_id, self._over_bounds(event.request_id, len(blocks) * block_size)
        if over is not None:  # kept short, and judged without a walk of its blocks
            request_id = request_id[:MAX_REQUEST_ID_CHARS]
        seen = Seen(request_id, model, str(event.router_id), now, chosen, len(blocks), block_size,
                    role or Role.aggregated, prefill_hint=add.prefill_tokens_hint if add.track_prefill_tokens else None,
                    stale=dict(stale) if stale else None, credit=config.overlap_score_credit,
                    router_blind=credited is not None and not credited[0] and credited[1] >= BLIND_EVIDENCE,
                    temperature=config.router_temperature,
                    approximate=state is not None and state.router.approx is not None)
        self.settle(now)  # judges kvctl's own waiting decisions too: the ring stays in the order heard
        if over is None and (state is None or role is None):
            self._wait_for(seen)
            return None
        scores = None
        if over is not None or fleet.tracking is not None or state is None or role is None:  # (no role: over bounds)
            verdict = judge(replace(seen, unresolved=over or "the fleet tracks requests by keyed hashes"), None)
        else:
            router = state.router
            path = router.index.path_of_sequence(blocks)
            resolved = len(path.local_hashes)
            if path.exhausted:
                verdict = judge(replace(seen, resolved=resolved, unresolved="a branch point with more children "
                                                                            "than the walk may try"), None)
            else:
                ranks = fleet.busy_ranks(model)
                busy = None if ranks is None else {w: r.busy for w, r in ranks.items()}
                pool = pools[role]
                scores = router.assess(pool, path.local_hashes, blocks, isl_tokens=len(blocks) * block_size,
                                       busy=busy, role=role)
                verdict = judge(replace(seen, resolved=resolved), scores)
        self._learn_credit(event.router_id, verdict)
        self._ledger.add(verdict, scores, len(blocks) * block_size)
        return verdict

    def _over_bounds(self, request_id: str, prompt_tokens: int) -> str | None:
        """Why a decision is too large to look into (what replica sync would refuse to book), or None."""
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            return f"a request id of {len(request_id)} characters, over {MAX_REQUEST_ID_CHARS}"
        limit = self.fleet.limits.max_request_tokens
        if prompt_tokens > limit:
            return f"a prompt of {prompt_tokens} tokens, over --max-request-tokens {limit}"
        return None

    def joined(self, worker: WorkerKey) -> None:
        """A worker registered: the decisions for it that waited are judged, with kvctl's view named as behind; and,
        mid-load, its next decisions too, for a while (`JOIN_GRACE_S`)."""
        if self._heard_at is not None:
            joined = self._joined
            for old in [w for w, at in joined.items() if self._heard_at - at >= JOIN_GRACE_S]:
                del joined[old]
            if len(joined) < MAX_PENDING:
                joined[worker] = self._heard_at
        waiting = [seen for seen in self._pending if seen.chosen == worker]
        if not waiting:
            return
        self._pending = deque(seen for seen in self._pending if seen.chosen != worker)
        for seen in waiting:
            behind = {**(seen.stale or {}), worker: "not registered with kvctl yet when it was routed to"}
            self._ledger.add(judge(replace(seen, stale=behind), None))

    def settle(self, now: float) -> None:
        """Judge kvctl's own waiting decisions, and those for an unregistered worker whose grace is over."""
        self.flush()
        pending = self._pending
        while pending and (now - pending[0].at >= JOIN_GRACE_S or len(pending) > MAX_PENDING):
            self._ledger.add(judge(pending.popleft(), None))

    @property
    def waiting(self) -> int:
        return len(self._pending)

    @property
    def unjudged(self) -> int:
        """kvctl's own decisions not judged yet."""
        return len(self._own)

    def _wait_for(self, seen: Seen) -> None:
        self._pending.append(seen)
        self.settle(seen.at)

    def _learn_credit(self, router_id: int, verdict: Verdict) -> None:
        """Whether a router credits cache at all, from its estimates of its picks that held some."""
        pick = verdict.picked
        if verdict.router_overlap is None or pick is None or pick.weighted < 1:
            return
        credited = self._credit_seen.get(router_id)
        if credited is None:
            if len(self._credit_seen) >= MAX_ROUTERS_TRACKED:
                del self._credit_seen[next(iter(self._credit_seen))]  # the longest known: routers restart
            credited = self._credit_seen[router_id] = [0, 0]
        credited[0 if verdict.router_overlap >= 1 else 1] += 1

