"""What a running router knows: its models (index + router + thresholds) and its workers.

The HTTP layer and the event sources call into `Fleet`; `Fleet` calls into the pure core. Every
method takes `now` from the caller, so the server owns the one clock.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any, Protocol

from kvctl import http_api as api
from kvctl.core.events import Cleared, EventData, Removed, RouterEvent, Stored, Tier
from kvctl.core.events.model_card import ModelCard, disaggregated_roles
from kvctl.core.events.plane import FREE, PREFILL_COMPLETED, ActiveLoad, ForwardPass
from kvctl.core.index import Status
from kvctl.core.index.kv_index import events_of
from kvctl.core.names import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MODEL,
    Role,
    SeqMark,
    StreamId,
    WorkerKey,
    format_worker,
    selects,
)
from kvctl.core.router.approx import ApproxConfig, ApproxIndexer
from kvctl.core.router.busy import (
    AllBusy,
    BusyThresholds,
    BusyTracker,
    RankBusy,
    Thresholds,
    WorkerLoad,
    check_admission,
)
from kvctl.core.router.policy_classes import QueueProfiles
from kvctl.core.router.queue import would_queue
from kvctl.core.router.router import Router
from kvctl.core.router.scoring import Decision, NoCandidates, Reason, RouterConfig
from kvctl.core.router.sequences import EXPIRY_S, ActiveRequest, ActiveSequences
from kvctl.core.router.sessions import SessionBook
from kvctl.core.tracking_hash import TrackingKey
from kvctl.core.words import counted
from kvctl.errors import NoWorkers, Refused, UnknownModel
from kvctl.server.audit import Auditor
from kvctl.server.health import Health
from kvctl.server.joined_hits import JoinedHits
from kvctl.server.route_limits import OverLimit, RouteLimits
from kvctl.server.worker_info import WorkerInfo

_DEVICE = Tier.device
_NO_THRESHOLDS = Thresholds()


ADD = "AddRequest"
SequenceListener = Callable[[str, str, "ActiveRequest | None", Mapping[str, Any]], None]
"""(model, action: ADD | PREFILL_COMPLETED | FREE, the request as it was tracked, the route request)."""


class UnknownWorker(KeyError):
    pass


class Journal(Protocol):
    """Told of every change that a snapshot holds once it is applied: the state log (`server.persistence`)."""

    def model(self, name: str, block_size: int) -> None: ...
    def worker(self, info: WorkerInfo) -> None: ...
    def unregister(self, worker_id: int, dp_rank: int | None) -> None: ...
    def batch(self, model: str, worker: WorkerKey, events: Sequence[EventData]) -> None: ...
    def seq(self, stream: StreamId, seq: int) -> None: ...


_EVENT_TYPES: dict[type, str] = {Stored: "stored", Removed: "removed", Cleared: "cleared"}
_STATUS_VALUES = {s: s.value for s in Status}  # an enum's .value is a Python-level property: slow per event


@dataclass
class ModelState:
    name: str
    router: Router
    applied: Counter[tuple[str, str]] = field(default_factory=Counter)  # (event type, status) -> count

    @property
    def block_size(self) -> int:
        return self.router.block_size


class Fleet:
    def __init__(self, *, block_size: int = DEFAULT_BLOCK_SIZE, config: RouterConfig | None = None,
                 seed: int | None = None, thresholds: Thresholds | None = None, approx: ApproxConfig | None = None,
                 request_expiry_s: float = EXPIRY_S, limits: RouteLimits | None = None,
                 queues: QueueProfiles | None = None, sessions: SessionBook | None = None,
                 tracking: TrackingKey | None = None) -> None:
        """`approx`: approximate mode (no KV events): every model indexes its own routing decisions. `queues`:
        the frontend's router queue's policy classes, whose verdict each pick carries (kvctl holds no request).
        `sessions`: session affinity on, its bindings. `tracking`: the key of Dynamo's keyed tracking hashes."""
        self.limits = limits or RouteLimits()
        self.queues = queues
        self.sessions = sessions
        self.tracking = tracking
        self.health = Health()  # what every entry point refused or lost, and the parts that are down
        self.audit = Auditor(self)  # every decision heard, judged against the index
        self.over_limit: Counter[str] = Counter()  # routes refused, by `RouteLimits` field
        self.all_busy: Counter[str] = Counter()  # routes refused (503) with every worker busy, by model
        self.joined: dict[tuple[str, WorkerKey], JoinedHits] = {}  # (model, worker) -> predicted vs engine-reported
        self.default_block_size = block_size
        self.default_config = config or RouterConfig()
        self.approx = approx
        self.request_expiry_s = request_expiry_s
        self._rng = random.Random(seed)
        self.models: dict[str, ModelState] = {}
        self.workers: dict[WorkerKey, WorkerInfo] = {}
        self._candidates: dict[str, list[WorkerKey]] = {}
        self.thresholds = BusyThresholds(thresholds or Thresholds())
        self.busy = BusyTracker()
        self.reported: dict[WorkerKey, tuple[ActiveLoad, float]] = {}  # load reports from the event plane
        self.forward_passes: dict[WorkerKey, tuple[ForwardPass, float]] = {}  # the last one of each worker
        self.sequence_listener: SequenceListener | None = None  # told of local add / prefill / free
        # Per model, its workers' roles by their model cards, once it has both prefill and decode workers: a
        # disaggregated fleet, routed as two pools (`pools`).
        self.disaggregated: dict[str, Counter[str]] = {}
        # told of each worker a reset cleared or an unregister removed: it holds nothing from before now
        self.clear_listeners: list[Callable[[WorkerKey], None]] = []
        self.last_route_at = float("-inf")  # housekeeping that can wait does so while routes come in
        self.journal: Journal | None = None
        # Each engine stream's last applied seq, kept with the index it describes (image and state log alike), so
        # that a restarted router asks the engines' replay for what they published while it was down.
        self.stream_seqs: dict[StreamId, int] = {}
        # Engine batches being applied a slice of the loop at a time (`ingest.streams.ModelWriter`), by (model, worker):
        # what applies the rest of each at once, called before anything else changes that worker's index.
        self.unfinished: dict[tuple[str, WorkerKey], Callable[[], None]] = {}
        self.cards: Mapping[int, ModelCard] = {}  # worker id -> its model card (an event plane's discovery)
        self.add_model(DEFAULT_MODEL)

    # ----- models and workers -----------------------------------------------------------------------

    def add_model(self, name: str, *, block_size: int | None = None, config: RouterConfig | None = None) -> ModelState:
        if name not in self.models:
            router = Router(block_size=block_size or self.default_block_size, config=config or self.default_config,
                            rng=self._rng, sequences=ActiveSequences(self.request_expiry_s),
                            approx=ApproxIndexer(self.approx, self._capacity) if self.approx is not None else None,
                            tracking=self.tracking, tracking_model=name)
            self.models[name] = ModelState(name, router)
            if self.journal is not None:
                self.journal.model(name, router.block_size)
        return self.models[name]

    def _capacity(self, worker: WorkerKey) -> int | None:
        """A rank's KV blocks (its card's, or as registered): what approximate LRU retains blocks against."""
        info = self.workers.get(worker)
        return None if info is None else info.total_blocks

    def model(self, name: str) -> ModelState:
        state = self.models.get(name)
        if state is None:
            raise UnknownModel(name, self.models)
        return state

    def register(self, info: WorkerInfo) -> WorkerInfo:
        """Known from now on (also created implicitly by a worker's first event); a model is created on demand."""
        self.add_model(info.model)
        if self.journal is not None:
            self.journal.worker(info)
        previous = self.workers.get(info.key)
        self.workers[info.key] = info
        self._candidates.pop(info.model, None)
        if previous is not None:
            self._candidates.pop(previous.model, None)
        self.audit.joined(info.key)
        return info

    def candidates(self, model: str) -> list[WorkerKey]:
        """The model's registered (worker, dp_rank)s, sorted; kept until the registry changes."""
        cached = self._candidates.get(model)
        if cached is None:
            cached = self._candidates[model] = sorted(w for w, info in self.workers.items() if info.model == model)
        return cached

    def check_worker(self, worker_id: int, dp_rank: int | None = None) -> list[WorkerKey]:
        """The registered keys of a worker (all its ranks, or one); raises UnknownWorker when none."""
        keys = [w for w in self.workers if selects((worker_id, dp_rank), w)]
        if not keys:
            raise UnknownWorker(worker_id)
        return keys

    def unregister(self, worker_id: int, dp_rank: int | None = None) -> api.Removed:
        gone = self.check_worker(worker_id, dp_rank)
        blocks = 0
        self._candidates.clear()
        for w in gone:
            self._finish(w)
            info = self.workers.pop(w)
            self.reported.pop(w, None)
            self.forward_passes.pop(w, None)
            router = self.models[info.model].router
            blocks += router.index.remove_worker(w[0], w[1])
            for request in router.sequences.requests(w):
                router.sequences.free(request.request_id, request.owner)
            self._cleared(w)
        if not any(w[0] == worker_id for w in self.workers):
            self.busy.forget(worker_id)
        for stream in [s for s in self.stream_seqs if s[0] in gone]:
            del self.stream_seqs[stream]
        if self.journal is not None:  # after the change, as every change: a write's mark counts the blocks held
            self.journal.unregister(worker_id, dp_rank)
        return api.Removed([api.WorkerRef(w[0], w[1]) for w in gone], blocks)

    # ----- events -------------------------------------------------------------------------------------

    def apply(self, model: str, events: Iterable[RouterEvent], now: float) -> tuple[int, Counter[str]]:
        """Apply events in order; returns (applied, rejected by kind). Unknown workers become known."""
        state = self.add_model(model)
        applied = 0
        rejected: Counter[str] = Counter()
        for worker, run in groupby(events, key=lambda e: (e.worker_id, e.dp_rank)):
            self._finish(worker, model)
            applied += self._apply_run(state, worker, (event.data for event in run), now, rejected)
        return applied, rejected

    def _finish(self, worker: WorkerKey, model: str | None = None) -> None:
        """Apply the rest of the worker's batch being applied in slices (in `model`, or any), if any, before another
        change to its index: the batch stays whole."""
        if self.unfinished:
            for key in [k for k in self.unfinished if k[1] == worker and model in (None, k[0])]:
                self.unfinished.pop(key)()

    def apply_engine_batch(self, model: str, worker: WorkerKey, events: Sequence[EventData], now: float,
                           mark: SeqMark | None = None) -> None:
        """`mark`: the engine stream and seq the batch came with. Told first, so that the journal's record of the
        seq never goes out without the batch's (see `StateLog.seq`)."""
        if mark is not None:
            self.applied_seq(*mark)
        if events:  # an empty batch (the writer's marker) makes no worker known; a worker with a model card is in
            # the model the card names, whichever model's writer brought its events (a plane's serves several)
            card = self.cards.get(worker[0])
            self._apply_run(self.add_model(model if card is None else card.model), worker, events, now, None)

    def applied_seq(self, stream: StreamId, seq: int) -> None:
        """`stream`'s batches up to `seq` are in the index (and in the journal's records before this one)."""
        self.stream_seqs[stream] = seq
        if self.journal is not None:
            self.journal.seq(stream, seq)

    def built(self, model: str, workers: Iterable[WorkerKey], stored: int, now: float) -> None:
        """A model's index was built in bulk from an image (`snapshot`): its workers are known and heard from,
        and its `stored` events counted, as replaying the image's events one by one leaves them."""
        state = self.add_model(model)
        for worker in workers:
            info = self.workers.get(worker)
            if info is None:
                info = self.register(WorkerInfo(worker[0], worker[1], model))
            info.last_event_at = now
        state.applied[(_EVENT_TYPES[Stored], _STATUS_VALUES[Status.ok])] += stored

    def mark_restored(self) -> None:
        """Once a restore is done: every worker it made known is restored, not heard from (no last event),
        until an event of this run arrives, so a restart never shows the state dir's workers as alive."""
        for info in self.workers.values():
            info.last_event_at, info.restored = None, True

    def _apply_run(self, state: ModelState, worker: WorkerKey, events: Iterable[EventData], now: float,
                   rejected: Counter[str] | None) -> int:
        """Apply one worker's events in order; returns how many applied, adds the others to `rejected`."""
        info = self._heard_of(worker, state.name)
        info.last_event_at, info.restored = now, False
        journal, kept = self.journal, None
        if journal is not None:
            events = kept = events if isinstance(events, list) else list(events)  # not the ABC: 0.3 us a batch
        index, counts = state.router.index, state.applied
        applied = 0
        for data in events:
            status = index.apply_data(worker, data).status
            counts[(_EVENT_TYPES[type(data)], _STATUS_VALUES[status])] += 1
            if status is Status.ok:
                applied += 1
            else:
                info.rejected[status.value] += 1
                if rejected is not None:
                    rejected[status.value] += 1
        if journal is not None and kept is not None:  # once applied: the write that takes it counts the blocks held
            journal.batch(state.name, worker, kept)
        return applied

    # ----- routing ------------------------------------------------------------------------------------

    def rank_busy(self, model: str) -> dict[WorkerKey, RankBusy]:
        state = self.model(model)
        thresholds = self.thresholds.get(model)
        sequences = state.router.sequences
        ranks = {}
        for w in self.candidates(model):
            ranks[w] = self.busy.update(w, self._load(w, sequences), thresholds)
        return ranks

    def busy_ranks(self, model: str) -> dict[WorkerKey, RankBusy] | None:
        """`rank_busy`, or None for a model with no threshold: nothing can be busy without one."""
        return None if self.thresholds.get(model) == _NO_THRESHOLDS else self.rank_busy(model)

    def _load(self, worker: WorkerKey, sequences: ActiveSequences) -> WorkerLoad:
        """The router's own view of a rank, plus the KV usage the worker last reported (if it did)."""
        load = sequences.load(worker)
        report = self.reported.get(worker)
        info = self.workers.get(worker)
        return WorkerLoad(load.active_blocks, load.active_prefill_tokens,
                          kv_used_blocks=report[0].kv_used_blocks if report else None,
                          total_blocks=info.total_blocks if info else None,
                          max_num_batched_tokens=info.max_num_batched_tokens if info else None)

    def pools(self, model: str) -> dict[Role, list[WorkerKey]]:
        """The model's candidates by the pool Dynamo picks each from: one aggregated pool, or, for a disaggregated
        model, its prefill workers and the rest (decode workers, and any its cards do not make prefill)."""
        candidates = self.candidates(model)
        if model not in self.disaggregated:
            return {Role.aggregated: candidates}
        workers = self.workers
        prefill = [w for w in candidates if workers[w].role == Role.prefill]
        return {Role.prefill: prefill, Role.decode: [w for w in candidates if workers[w].role != Role.prefill]}

    def route(self, model: str, *, now: float, **request: Any) -> Decision:
        """A disaggregated model's decision is its prefill pick, its decode pick in `decode`. Raises UnknownModel,
        OverLimit, AllBusy (every worker of a pool busy), NoWorkers (a pool with no worker), Refused (a
        disaggregated model asked to reserve)."""
        state = self.model(model)
        self._check_limits(state, request)
        pools = self.pools(model)
        if request.get("reserve") and Role.aggregated not in pools:
            raise Refused(f"model {model!r} is disaggregated ({disaggregated_roles(self.disaggregated[model])}): "
                          "kvctl does not book a request on two pools yet; route it without reserving", status=409)
        busy = None
        if (ranks := self.busy_ranks(model)) is not None:
            try:
                for pool in pools.values():
                    check_admission(model, {w: ranks[w] for w in pool}, self.thresholds.get(model))
            except AllBusy:
                self.all_busy[model] += 1
                raise
            busy = {w: r.busy for w, r in ranks.items()}
        session_id = request.pop("session_id", None)
        picks = [self._pick(state, role, pool, busy, now, session_id, request) for role, pool in pools.items()]
        decision = picks[0] if len(picks) == 1 else dataclasses.replace(picks[0], decode=picks[1])
        self.last_route_at = now
        if (chosen := self.workers.get(decision.worker)) is not None:
            chosen.routes += 1
        if request.get("reserve") and self.sequence_listener is not None:
            self.sequence_listener(model, ADD, state.router.sequences.get(request["request_id"]), request)
        self.audit.own(model, decision, request.get("request_id"), _isl(request, state.block_size), now)
        return decision

    def _pick(self, state: ModelState, role: Role, pool: list[WorkerKey], busy: Mapping[WorkerKey, bool] | None,
              now: float, session_id: str | None, request: dict[str, Any]) -> Decision:
        """One pool's pick: the session's pinned worker while it is in the pool (a booked route pins it), else
        the cost function's; with the verdict of the frontend's router queue."""
        sessions = self.sessions
        pinned = None
        if sessions is not None and session_id is not None and (held := sessions.pinned(role, session_id, now)):
            pinned = held if held in pool else None
        try:
            pick = state.router.route([pinned] if pinned else pool, busy=busy, now=now, role=role, **request)
        except NoCandidates:
            raise NoWorkers(state.name, Counter(info.model for info in self.workers.values()),
                            None if role is Role.aggregated else role) from None
        if pinned:
            pick = dataclasses.replace(pick, reason=Reason.pinned)
        elif sessions is not None and session_id is not None and request.get("reserve"):
            sessions.bind(role, session_id, pick.worker, now)
        if self.queues is not None:
            sequences = state.router.sequences
            best = max(pick.scores.effective, default=0.0) * state.block_size  # the column: no rows built
            isl = _isl(request, state.block_size)
            policy_class = self.queues.profile(state.name).classify(isl - min(isl, math.floor(best + 0.5)))
            verdict = would_queue(policy_class, {w: self._load(w, sequences) for w in pool})
            if verdict is not None:
                pick = dataclasses.replace(pick, queued=verdict)
        return pick

    def _check_limits(self, state: ModelState, request: Mapping[str, Any]) -> None:
        limits, block_size = self.limits, state.block_size
        tokens = _isl(request, block_size)
        over = None
        if tokens > limits.max_request_tokens:
            over = "max_request_tokens", f"{tokens} prompt tokens, over {limits.max_request_tokens}"
        elif request.get("reserve"):
            sequences = state.router.sequences
            if len(sequences) >= limits.max_reservations:
                over = "max_reservations", (f"{counted(len(sequences), 'request')} of model {state.name!r} in flight "
                                            f"already, the most it may have")
            elif (sequences.blocks + tokens // block_size) * block_size > limits.max_reserved_tokens:
                over = "max_reserved_tokens", (
                    f"{sequences.blocks * block_size} prompt tokens of model {state.name!r} in flight, and "
                    f"{tokens} more would pass {limits.max_reserved_tokens}")
        if over is not None:
            self.over_limit[over[0]] += 1
            raise OverLimit(*over)

    def prefill_complete(self, model: str, request_id: str, cached_tokens: int | None = None) -> bool:
        """`cached_tokens`: what the engine reported it found cached for the request (its usage's
        `prompt_tokens_details.cached_tokens`), joined with the router's prediction for the same request."""
        state = self.model(model)
        request = state.router.sequences.get(request_id)
        done = self._settle(model, request_id, PREFILL_COMPLETED)
        if done and request is not None and cached_tokens is not None:
            self.joined.setdefault((model, request.worker), JoinedHits()).add(request, cached_tokens,
                                                                              state.block_size)
        return done

    def free(self, model: str, request_id: str) -> bool:
        return self._settle(model, request_id, FREE)

    def _settle(self, model: str, request_id: str, action: str) -> bool:
        router = self.model(model).router
        request = router.sequences.get(request_id)
        done = router.free(request_id) if action == FREE else router.sequences.mark_prefill_completed(request_id)
        if done and self.sequence_listener is not None:
            self.sequence_listener(model, action, request, {})
        return done

    # ----- the event plane ------------------------------------------------------------------------------

    def report_load(self, load: ActiveLoad, now: float, model: str) -> None:
        worker = (load.worker_id, load.dp_rank)
        self.reported[worker] = (load, now)
        self._heard_of(worker, model)

    def report_forward_pass(self, report: ForwardPass, now: float, model: str) -> None:
        worker = (report.worker_id, report.dp_rank)
        self.forward_passes[worker] = (report, now)
        self._heard_of(worker, model)

    def _heard_of(self, worker: WorkerKey, model: str) -> WorkerInfo:
        """A worker the event plane speaks of is a candidate before its first KV event, as Dynamo's routers
        know it from discovery: an idle worker that has stored nothing yet must still get requests. One with a
        model card is in the model the card names (not `model`), with what the card says of it."""
        info = self.workers.get(worker)
        if info is None:
            card = self.cards.get(worker[0])
            info = WorkerInfo(worker[0], worker[1], model if card is None else card.model)
            if card is not None:
                info.take_card(card)
            self.register(info)
        return info

    def rehome(self, cards: Mapping[int, ModelCard], now: float) -> list[WorkerKey]:
        """Each worker in the model its card names: from now on, and for one heard of before its card, moved there
        whole with its blocks (nothing cleared, so nothing to recover again); requests booked on it in its old
        model end. One capture per old model. Returns the ranks moved."""
        self.cards = cards
        homes = {worker_id: card.model for worker_id, card in cards.items()}
        moved = sorted(w for w, info in self.workers.items() if homes.get(w[0], info.model) != info.model)
        for name in {self.workers[w].model for w in moved}:
            keys = {w for w in moved if self.workers[w].model == name}
            for w in keys:
                self._finish(w)
            router = self.models[name].router
            edges = [edge for edge in router.index.capture() if edge.worker in keys]
            for w in sorted(keys):
                router.index.remove_worker(*w)
                for request in router.sequences.requests(w):
                    router.sequences.free(request.request_id, request.owner)
                if self.journal is not None:
                    self.journal.unregister(*w)
                self.register(dataclasses.replace(self.workers[w], model=homes[w[0]]))
            for home in {homes[w[0]] for w in keys}:
                self.apply(home, events_of(e for e in edges if homes[e.worker[0]] == home), now)
        return moved

    def reclaim_debt(self) -> int:
        """Freed index lookup entries not given back yet, every model (`RadixTree.debt`)."""
        return sum(state.router.index.debt for state in self.models.values())

    def reclaim(self, budget: int) -> bool:
        """Memory of freed index nodes given back (`RadixTree.reclaim`), every model; True while more is left."""
        more = False
        for state in self.models.values():
            more = state.router.index.reclaim(budget) or more
        return more

    def tick(self, now: float) -> None:
        """Time-driven housekeeping of every model: stale requests, approximate-mode expiry; idle sessions."""
        for state in self.models.values():
            state.router.tick(now)
        if self.sessions is not None:
            self.sessions.expire(now)

    # ----- views and levers ---------------------------------------------------------------------------

    def worker_rows(self, now: float) -> list[api.Worker]:
        rows = []
        mismatches = {name: state.router.index.hash_mismatches() for name, state in self.models.items()}
        agreements = {name: state.router.index.hash_agreements() for name, state in self.models.items()}
        for w, info in sorted(self.workers.items()):
            router = self.models[info.model].router
            load = router.sequences.load(w)
            rank = self.busy.update(w, self._load(w, router.sequences), self.thresholds.get(info.model))
            report = self.reported.get(w)
            passed = self.forward_passes.get(w)
            rows.append(api.Worker(
                worker_id=info.worker_id, dp_rank=info.dp_rank, model=info.model,
                endpoint=info.endpoint, replay_endpoint=info.replay_endpoint, topic=info.topic,
                blocks=router.index.device.size(w),
                active_decode_blocks=load.active_blocks, active_prefill_tokens=load.active_prefill_tokens,
                active_requests=load.requests, busy=rank.busy,
                last_event_age_s=None if info.last_event_at is None else round(now - info.last_event_at, 3),
                total_blocks=info.total_blocks, rejected_events=dict(info.rejected),
                hash_mismatches=mismatches[info.model].get(w, 0),
                hash_agreements=agreements[info.model].get(w, 0), routes=info.routes,
                reported=None if report is None else api.Reported(
                    report[0].active_decode_blocks, report[0].active_prefill_tokens, report[0].kv_used_blocks,
                    round(now - report[1], 3)),
                forward_pass=None if passed is None else _forward_pass_row(*passed, now), restored=info.restored,
                role=info.role, publishes_kv_events=info.publishes_kv_events,
                max_num_batched_tokens=info.max_num_batched_tokens,
            ))
        return rows

    def stats(self, model: str | None = None) -> api.TreeStats:
        names = [model] if model is not None else sorted(self.models)
        out: dict[str, api.ModelStats] = {}
        for name in names:
            index = self.model(name).router.index
            tiers = index.stats()
            device = tiers[_DEVICE]
            out[name] = api.ModelStats(
                block_size=self.models[name].block_size, blocks=device.blocks, nodes=device.nodes,
                workers={format_worker(w): n for w, n in sorted(device.workers.items())},
                tiers={t.value: api.TierStats(s.blocks, s.nodes) for t, s in tiers.items()})
            approx = self.models[name].router.approx
            if self.approx is not None and approx is not None:  # the cap it is pruned at: blocks near it mean churn
                lru = None if approx.lru is None else api.LruRetention(*dataclasses.astuple(approx.lru.stats()))
                out[name].approximate = api.Approximate(self.approx.max_tree_size, self.approx.ttl_s,
                                                        self.approx.prune_target_ratio, self.approx.policy, lru,
                                                        approx.pruned)
        return api.TreeStats(out)

    def reset(self, model: str | None, worker_id: int | None, dp_rank: int | None) -> api.Cleared:
        """Clear state: every model, one model, or one worker (optionally one rank) of it."""
        names = [model] if model is not None else sorted(self.models)
        cleared: list[api.ClearedModel] = []
        for name in names:
            index = self.model(name).router.index
            before = index.stats()[_DEVICE]
            workers = index.workers()
            if worker_id is not None:
                workers = [w for w in workers if selects((worker_id, dp_rank), w)]
            for w in workers:
                self._finish(w, name)
                index.apply(RouterEvent(w[0], Cleared(), w[1]))
                if self.journal is not None:
                    self.journal.batch(name, w, [Cleared()])
                if (info := self.workers.get(w)) is not None:
                    info.rejected.clear()  # a fresh start: what doctor reports from here is new
                self._cleared(w)
            after = index.stats()[_DEVICE]
            cleared.append(api.ClearedModel(name, [format_worker(w) for w in sorted(workers)],
                                        before.blocks - after.blocks))
        if model is None and worker_id is None:  # the index started over: what a restore missed is moot
            self.health.recover("state_dir")
        return api.Cleared(cleared)

    def _cleared(self, worker: WorkerKey) -> None:
        for listener in self.clear_listeners:
            listener(worker)


def _forward_pass_row(report: ForwardPass, at: float, now: float) -> api.ForwardPass:
    """A worker's last forward pass as `workers` shows it: what ran in it and what still waits."""
    scheduled, queued = report.scheduled, report.queued
    return api.ForwardPass(
        scheduled_prefill_requests=scheduled.prefill_requests, scheduled_prefill_tokens=scheduled.prefill_tokens,
        scheduled_decode_requests=scheduled.decode_requests, queued_prefill_requests=queued.prefill_requests,
        queued_prefill_tokens=queued.prefill_tokens, queued_decode_requests=queued.decode_requests,
        wall_time_s=report.wall_time, counter_id=report.counter_id, age_s=round(now - at, 3))


def _isl(request: Mapping[str, Any], block_size: int) -> int:
    """A route's prompt tokens: its token ids, or its local hashes' full blocks."""
    tokens = request.get("token_ids")
    return len(tokens) if tokens is not None else len(request.get("local_hashes") or ()) * block_size
