"""The HTTP API of `kvctl serve` (docs/http-api.md), defined once: every request and answer body as a msgspec Struct.

The server decodes requests into these and encodes its answers from them, the clients decode the answers with
them, and `/openapi.json` describes them (`msgspec.json.schema_components`). A field's name, type and optionality
here are what is on the wire: a field that is `UNSET` is left out of the JSON, one that is None is `null`.
Integers are exact (hashes and worker ids are u64, past 2^53). Objects keyed by data (per-worker `ID:DP` maps,
per-model maps, counts by kind) are `dict[str, X]`. Sub-objects that the router's event sources describe
themselves (engine streams, the event plane, the decoder) are left open: `dict[str, Any]`.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import UNSET, Meta, Raw, Struct, UnsetType

from kvctl.core.names import DEFAULT_MODEL, MAX_DP_RANK, MAX_WORKER_ID

# The decision audit's bodies (docs/audit.md) are the API's, named here; they live in a module of their own for size.
from kvctl.http_audit import Audit as Audit
from kvctl.http_audit import AuditedDecision as AuditedDecision
from kvctl.http_audit import AuditRow as AuditRow
from kvctl.http_audit import AuditTotals as AuditTotals
from kvctl.http_audit import AuditWhatIf as AuditWhatIf
from kvctl.http_audit import AuditWorker as AuditWorker
from kvctl.http_audit import DecisionsHeard as DecisionsHeard

_U32_MAX = 2**32 - 1

U32 = Annotated[int, Meta(ge=0, le=MAX_DP_RANK)]
U64 = Annotated[int, Meta(ge=0, extra_json_schema={"maximum": MAX_WORKER_ID})]
"""A u64 (hashes, worker ids): msgspec's bounds stop at int64, so the upper one (`MAX_WORKER_ID`) is checked
where one is read (`over_u64`)."""
Count = Annotated[int, Meta(ge=0)]
Weight = Annotated[float, Meta(ge=0)]
SessionId = Annotated[str, Meta(min_length=1, max_length=1024)]
TokenIds = Annotated[Raw, Meta(extra_json_schema={
    "anyOf": [{"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": _U32_MAX}},
              {"type": "null"}]})]
"""A route's token ids, kept as their raw JSON: the router reads them with its own u32 reader."""


def over_u64(*values: int | None) -> bool:
    """Whether a value that `U64` let through is past u64 after all."""
    return any(v is not None and v > MAX_WORKER_ID for v in values)


def token_ids_json(token_ids: list[int]) -> Raw:
    """`RouteBody.token_ids` of a list of ids."""
    return Raw(msgspec.json.encode(token_ids))


# ----- requests -------------------------------------------------------------------------------------------------


class RouteBody(Struct, forbid_unknown_fields=True):
    """A request to route: the prompt's `token_ids` (or its blocks' `local_hashes`) for a `model`, and optionally
    this request's own router settings, by their Dynamo names. Unknown fields are refused (422)."""

    model: str = DEFAULT_MODEL
    token_ids: TokenIds | UnsetType = UNSET
    local_hashes: list[U64] | None = None
    lora_name: str | None = None
    cache_salt: str | None = None  # SGLang's: the prompt's blocks hash under it, as its engine's stores do
    request_id: str | None = None
    reserve: bool = False
    explain: bool = False
    session_id: SessionId | None = None  # with session affinity on: its pinned worker (a booked route pins it)
    # This request's own router knobs (docs/contract.md), by their Dynamo names; the last two are legacy aliases.
    overlap_score_credit: Weight | None = None
    overlap_score_credit_decay: Weight | None = None
    prefill_load_scale: Weight | None = None
    decode_active_request_weight: Weight | None = None
    host_cache_hit_weight: Weight | None = None
    disk_cache_hit_weight: Weight | None = None
    router_temperature: Weight | None = None
    track_prefill_tokens: bool | None = None
    overlap_score_weight: Weight | None = None
    temperature: Weight | None = None


class WorkerBody(Struct, forbid_unknown_fields=True):
    """A worker to register and, with an `endpoint`, follow: its engine's PUB socket (tcp://HOST:PORT, ipc://PATH
    or inproc://NAME) and replay socket (`replay_endpoint`), in the same forms."""

    worker_id: U64
    dp_rank: U32 = 0
    endpoint: str | None = None
    replay_endpoint: str | None = None
    model: str = DEFAULT_MODEL
    topic: str = ""
    total_blocks: Annotated[int, Meta(gt=0)] | None = None


class PrefillBody(Struct, forbid_unknown_fields=True):
    """What the engine reported for a request whose prefill is done: `cached_tokens`, the prompt tokens it found
    cached (its usage's prompt_tokens_details.cached_tokens)."""

    cached_tokens: Count | None = None


class ResetBody(Struct, forbid_unknown_fields=True):
    """What to clear: each field narrows it (null: all)."""

    model: str | None = None
    worker_id: U64 | None = None
    dp_rank: U32 | None = None


class BusyBody(Struct):
    """A model and the thresholds to set (a threshold not named keeps its value). Unknown fields are ignored;
    numbers must be JSON numbers, not strings."""

    model: str
    active_decode_blocks_threshold: float | None = None
    active_prefill_tokens_threshold: Count | None = None
    active_prefill_tokens_threshold_frac: float | None = None


# ----- answers --------------------------------------------------------------------------------------------------


class Error(Struct):
    """What is wrong (`error`), with, where they help the next try, the fields that give its context."""

    error: str
    models: list[str] | UnsetType = UNSET  # the models there are (an unknown model)
    limit: str | UnsetType = UNSET  # the cap a route went over (429), and the flag that sets it
    flag: str | UnsetType = UNSET
    thresholds: Thresholds | UnsetType = UNSET  # every worker busy (503): the model's thresholds
    tripped: dict[str, list[str]] | UnsetType = UNSET  # and what each `ID:DP` is over
    restoring: Readiness | UnsetType = UNSET  # a restart restoring its index (503): how far it is
    workers_by_model: dict[str, int] | UnsetType = UNSET  # a model with no workers (503): the models with some


class InvalidField(Struct):
    """One invalid part of a request: where (`loc`: "body" or "query", then the field) and what is wrong."""

    type: str
    loc: list[str | int]
    msg: str


class Invalid(Struct):
    """A request whose body or query does not fit its schema (422)."""

    detail: list[InvalidField]


class Candidate(Struct):
    """One (worker, dp_rank) of an explained decision: every number that went into its logit."""

    worker_id: int
    dp_rank: int
    overlap_blocks: int
    overlap_by_tier: dict[str, int]
    credit_by_tier: dict[str, float]
    credit: float
    decay: float
    effective_overlap: float
    tree_size: int
    raw_prefill_blocks: float
    prefill_blocks: float
    decode_blocks: int
    active_requests: int
    logit: float
    busy: bool


class Queued(Struct):
    """Why Dynamo's frontend would hold a request in its router queue before dispatching it (kvctl holds none):
    the policy class the request falls in (`default` with the flags), its queue's order, and every rank's prefill
    tokens in flight over one of the class's thresholds: `threshold` times its max batched tokens, or
    `threshold_tokens` (`over`: per rank, `active_prefill_tokens_frac TOKENS > LIMIT` or
    `active_prefill_tokens TOKENS > LIMIT`)."""

    policy: str
    threshold: float | None
    over: dict[str, str]
    policy_class: str = "default"
    threshold_tokens: int | None = None


class Decision(Struct):
    """Where a request should go, and why (`reason`: only_candidate, lowest_logit, tie_random or sampled);
    `candidates` when it was asked to explain. A disaggregated model's answer is its prefill pick (`role`
    prefill), with its decode pick, made apart, in `decode` (`role` decode)."""

    worker_id: int
    dp_rank: int
    overlap_blocks: int
    required_blocks: int
    request_id: str | None
    reason: str
    candidates: list[Candidate] | UnsetType = UNSET
    role: str | UnsetType = UNSET  # the pool picked from, on a disaggregated model only
    decode: Decision | UnsetType = UNSET
    queued: Queued | UnsetType = UNSET  # with --router-queue-threshold, when the frontend would queue it


class PrefillCompleted(Struct):
    request_id: str
    prefill_complete: bool = True


class Freed(Struct):
    request_id: str
    freed: bool = True


class Reported(Struct):
    """A worker's load as it reported it on an event plane."""

    active_decode_blocks: int | None
    active_prefill_tokens: int | None
    kv_used_blocks: int | None
    age_s: float


class ForwardPass(Struct):
    """A worker's last forward pass: what ran in it and what still waits."""

    scheduled_prefill_requests: int
    scheduled_prefill_tokens: int
    scheduled_decode_requests: int
    queued_prefill_requests: int
    queued_prefill_tokens: int
    queued_decode_requests: int
    wall_time_s: float
    counter_id: int
    age_s: float


class KvCacheGroup(Struct):
    """One KV cache group of a worker's model (a hybrid model has several), as its engine stream showed it, per
    DP rank: its index, its kind (`full_attention`, `sliding_window`, `mamba`, ...; null while no store has named
    it), its sliding window and block size in tokens (null where no event said), and its events kept (indexed)
    and dropped (as Dynamo 1.6.1, only full-attention groups are indexed)."""

    dp_rank: int
    group_idx: int
    kind: str | None
    sliding_window: int | None
    block_size: int | None
    events_kept: int
    events_dropped: int


class Worker(Struct):
    """One (worker, dp_rank) the router knows. `reported` and `forward_pass`: what it said of itself on an event
    plane (null otherwise); `event_plane`, with an event plane, where its events come from. `restored`: known
    only from the state dir, nothing heard since the router started (`last_event_age_s` is then null). `role`
    (aggregated, prefill, decode), `publishes_kv_events` and `max_num_batched_tokens`: from its model card, null
    without one. `groups`, `salts_seen` and `events_dropped`: what the engine stream that follows it showed (its
    KV cache groups, how many distinct cache salts its stores carried, never the salts, and the events it did
    not index, by cause), as `/v1/status` shows them under `streams`; absent where no engine stream follows it."""

    worker_id: int
    dp_rank: int
    model: str
    endpoint: str | None
    replay_endpoint: str | None
    topic: str
    blocks: int
    active_decode_blocks: int
    active_prefill_tokens: int
    active_requests: int
    busy: bool
    last_event_age_s: float | None
    total_blocks: int | None
    rejected_events: dict[str, int]
    hash_mismatches: int
    hash_agreements: int
    routes: int
    reported: Reported | None
    forward_pass: ForwardPass | None
    event_plane: dict[str, Any] | None | UnsetType = UNSET
    restored: bool = False
    role: str | None = None
    publishes_kv_events: bool | None = None
    max_num_batched_tokens: int | None = None  # from its model card: the prefill busy and queue limits' unit
    groups: list[KvCacheGroup] | UnsetType = UNSET
    salts_seen: int | UnsetType = UNSET  # counted up to 4096
    events_dropped: dict[str, int] | UnsetType = UNSET


class Workers(Struct):
    workers: list[Worker]


class WorkerRef(Struct):
    worker_id: int
    dp_rank: int


class Removed(Struct):
    """A worker forgotten: its ranks, the blocks they held, and (with engine streams) the streams stopped."""

    removed: list[WorkerRef]
    blocks: int
    streams_stopped: int | UnsetType = UNSET


class EventsApplied(Struct):
    """Events applied, and the others counted by why (a decode error's kind or an apply status)."""

    applied: int
    rejected: dict[str, int]


class TierStats(Struct):
    blocks: int
    nodes: int


class LruRetention(Struct):
    """Approximate LRU's ranks: retained against their capacity, or on TTL for want of one; the blocks they hold
    and how many of those are past capacity (held by requests in flight)."""

    lru_ranks: int
    ttl_ranks: int
    resident_blocks: int
    overcapacity_blocks: int


class Approximate(Struct):
    """The cap an approximate-mode index is pruned at, its entries' life, and its cache policy (`lru`: with what
    each rank retains)."""

    max_tree_size: int
    ttl_s: float
    prune_target_ratio: float
    policy: str = "ttl"
    lru: LruRetention | None = None
    pruned_blocks: int = 0  # pairs the cap pruned since start: kvctl's memory bound, which 1.6.1 does not have


class ModelStats(Struct):
    """A model's index: its device tier's blocks and nodes, blocks per `ID:DP`, each tier's size."""

    block_size: int
    blocks: int
    nodes: int
    workers: dict[str, int]
    tiers: dict[str, TierStats]
    approximate: Approximate | UnsetType = UNSET
    # `?shape=true` (what `kvctl tree stats` shows beyond the sizes): distinct blocks, a depth histogram in
    # power-of-two buckets, and the deepest prefixes held by the most workers
    paths: int | UnsetType = UNSET
    depths: list[DepthBucket] | UnsetType = UNSET
    shared_prefixes: list[dict[str, Any]] | UnsetType = UNSET


class DepthBucket(Struct):
    """Distinct blocks, and (worker, block) pairs, at depths min..max of the tree."""

    min: int
    max: int
    blocks: int
    held: int


class TreeStats(Struct):
    models: dict[str, ModelStats]


class ClearedModel(Struct):
    model: str
    workers: list[str]  # `ID:DP`
    blocks: int


class Cleared(Struct):
    cleared: list[ClearedModel]


class Thresholds(Struct):
    """A model's busy thresholds; null for one that is off."""

    model: str
    active_decode_blocks_threshold: float | None
    active_prefill_tokens_threshold: int | None
    active_prefill_tokens_threshold_frac: float | None


class ThresholdsList(Struct):
    thresholds: list[Thresholds]


class Health(Struct):
    status: str
    version: str


class Readiness(Struct):
    """`GET /readyz`: "ready" (200) once the index is whole, "restoring" (503) while a restart restores it, with
    how far: `done` of `total` `unit`s of the restore's current `phase`; "degraded" (503) while a part the router
    needs to see a model is down, "partial" (200) while the index misses what it acknowledged (`faults` says
    which and why)."""

    status: str
    phase: str | UnsetType = UNSET
    done: int | UnsetType = UNSET
    total: int | UnsetType = UNSET
    unit: str | UnsetType = UNSET
    percent: float | UnsetType = UNSET
    elapsed_s: float | UnsetType = UNSET
    restore_s: float | None | UnsetType = UNSET  # how long the restore took (ready)
    faults: list[str] | UnsetType = UNSET  # "partial" (200) or "degraded" (503): each fault's part and reason


class ConnectionStats(Struct):
    """The limits on client connections (serve --idle-timeout, --max-connections, --max-head-bytes,
    --head-timeout) and what they did (heads refused: `health.losses`, surface "http")."""

    idle_timeout_s: float
    max: int
    open: int
    refused: int
    timed_out: int
    max_head_bytes: int | UnsetType = UNSET
    head_timeout_s: float | UnsetType = UNSET


class PartFault(Struct):
    """A part of the router that is down, or an index that is missing what it acknowledged (issue 36)."""

    part: str
    reason: str
    fix: str
    blocks_ready: bool  # /readyz answers 503 while it holds
    for_s: float


class InputLoss(Struct):
    """Inputs refused or dropped at an entry point (`surface`) for one `cause`, since start."""

    surface: str
    cause: str
    count: int
    last_s_ago: float
    detail: str  # the last one, in words
    fix: str


class HealthLedger(Struct):
    """What the router could not take in or see, in `/v1/status`: nothing it refused or lost is silent."""

    faults: list[PartFault]
    losses: list[InputLoss]


class Limits(Struct):
    """The caps on what a route may make the router hold (serve --max-*), and routes each `refused`."""

    max_request_tokens: int
    max_reservations: int
    max_reserved_tokens: int
    refused: dict[str, int]


class Status(Struct):
    """Everything `kvctl router status`, `doctor` and `top` read."""

    version: str
    native_speedups: str
    uptime_s: float
    rss_bytes: int | None
    models: dict[str, ModelStats]
    streams: list[dict[str, Any]]
    queues: list[dict[str, Any]]
    engines: dict[str, Any] | None
    decoder: dict[str, Any] | None
    event_plane: dict[str, Any] | None
    restore: dict[str, Any] | None
    connections: ConnectionStats
    limits: Limits
    loop: LoopHeld | UnsetType = UNSET  # a router before 0.x reports none
    readiness: Readiness | UnsetType = UNSET  # a router before /readyz reports none
    health: HealthLedger | UnsetType = UNSET  # a router before issue 36 reports none
    modes: RoutingModes | UnsetType = UNSET  # a router before issue 38 reports none


class RoutingModes(Struct):
    """The frontend behaviours the router mirrors, null where off: its router queue's verdicts (`threshold`,
    `policy`) and session affinity (`ttl_s`, the `sessions` pinned now, those `evicted` for room)."""

    queue: dict[str, Any] | None
    session_affinity: dict[str, Any] | None


class LoopHeld(Struct):
    """How long the router's loop was held past its promise (`tolerance_s`): since start, and in the last window."""

    tolerance_s: float
    blocked_s: float
    stalls: int
    window_s: float
    window_blocked_share: float
    window_stalls: int
    window_longest_s: float
