"""Busy thresholds: when a worker can take no more requests, and the refusal when none can (docs/contract.md).

Dynamo's frontend (`worker_monitor.rs`) marks a dp rank busy when its queued prefill tokens pass an
absolute or a max-batched-relative limit, or when its decode latch is set; a worker is busy when all
its ranks are, and a request is refused (HTTP 503) only when every worker of the model is busy.
kvctl keeps those semantics, and adds what an operator needs when the 503 arrives: every verdict
carries the signals that tripped, with their values and thresholds, so the refusal can say why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from kvctl.core.names import WorkerKey, format_worker
from kvctl.core.words import counted

DEFAULT_MAX_NUM_BATCHED_TOKENS = 10_000_000
"""Used when a worker reports no max_num_batched_tokens (Dynamo's DEFAULT_MAX_TOKENS): high enough
that the frac check cannot fire on realistic loads for a worker that never said its batch size."""

_U64_MAX = 2**64 - 1  # Dynamo reads the absolute threshold as a u64: kvctl accepts what Dynamo accepts
MAX_PREFILL_FRAC = 1e6
"""The largest `active_prefill_tokens_threshold_frac`: a million batches of prompt tokens queued is already
"never busy", and any larger multiple (Dynamo takes any f64) overflowed the token limit into a 500."""


class ThresholdError(ValueError):
    """A threshold value (or name) that cannot be set; `field` names it. The server answers 400, as Dynamo."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _number(field: str, value: object, upper: float, allowed: str) -> float:
    # The chained comparison also rejects NaN; bool is an int to Python but never a threshold.
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= upper:
        raise ThresholdError(field, f"{field} must be {allowed}, got {value!r}")
    return float(value)


def _decode_fraction(field: str, value: object) -> float:
    return _number(field, value, 1.0, "a number in [0.0, 1.0] (a fraction of the worker's KV blocks)")


def _prefill_frac(field: str, value: object) -> float:
    return _number(field, value, MAX_PREFILL_FRAC,
                   f"a number in [0.0, {MAX_PREFILL_FRAC:g}] (times max_num_batched_tokens)")


def _prefill_tokens(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _U64_MAX:
        raise ThresholdError(field, f"{field} must be an integer in [0, 2^64-1] (prompt tokens), got {value!r}")
    return value


_VALIDATORS: dict[str, Callable[[str, object], float | int]] = {
    "active_decode_blocks_threshold": _decode_fraction,
    "active_prefill_tokens_threshold": _prefill_tokens,
    "active_prefill_tokens_threshold_frac": _prefill_frac,
}
THRESHOLD_FIELDS = tuple(_VALIDATORS)
"""The threshold names, in the order of Dynamo's API object."""


@dataclass(frozen=True, slots=True)
class Thresholds:
    """One model's busy thresholds; None disables a check. Validated on construction: a bad one cannot exist.

    Fractions are stored as floats so the API object reads as Dynamo's f64 fields do (1.0, not 1).
    """

    active_decode_blocks_threshold: float | None = None
    active_prefill_tokens_threshold: int | None = None
    active_prefill_tokens_threshold_frac: float | None = None

    def __post_init__(self) -> None:
        for name, validate in _VALIDATORS.items():
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, validate(name, value))

    def as_dict(self, model: str) -> dict[str, object]:
        """The object of Dynamo's `/busy_threshold` API: the model and its three thresholds (None → null)."""
        return {"model": model, **{name: getattr(self, name) for name in THRESHOLD_FIELDS}}


DISABLED = Thresholds()
"""kvctl's thresholds for a model nobody configured: no check, no refusal (Dynamo's all-None)."""

DYNAMO_DEFAULTS = Thresholds(1.0, 10_000_000, 10.0)
"""The Dynamo frontend's CLI defaults, for a `kvctl serve` that should behave like a stock frontend."""


def _check_names(names: Iterable[str]) -> None:
    for name in names:
        if name not in _VALIDATORS:
            raise ThresholdError(name, f"unknown threshold {name!r}; the thresholds are {', '.join(THRESHOLD_FIELDS)}")


class BusyThresholds:
    """Thresholds per model, with the semantics of Dynamo's POST (merge) plus an explicit unset.

    Whether a model exists is the server's business (Dynamo answers 404 for an unknown one): the
    registry stores any model string, and answers `default` for a model never set.
    """

    def __init__(self, default: Thresholds = DISABLED) -> None:
        self._default = default
        self._by_model: dict[str, Thresholds] = {}

    def get(self, model: str) -> Thresholds:
        return self._by_model.get(model, self._default)

    def all(self) -> dict[str, Thresholds]:
        """The models whose thresholds were set or unset here; the others have the default."""
        return dict(self._by_model)

    def set(self, model: str, **fields: float | None) -> Thresholds:
        """Merge: each non-None field replaces the model's value, None leaves it, as Dynamo's POST does.

        Nothing changes if any field is invalid: the whole update is validated before it is stored.
        """
        _check_names(fields)
        # Any: the fields differ in type, and Thresholds validates whatever it is given (`__post_init__`).
        changes: dict[str, Any] = {name: value for name, value in fields.items() if value is not None}
        return self._store(model, dataclasses.replace(self.get(model), **changes))

    def unset(self, model: str, *field_names: str) -> Thresholds:
        """Disable the named checks: kvctl's addition, since Dynamo's merge cannot unset over HTTP."""
        _check_names(field_names)
        return self._store(model, dataclasses.replace(self.get(model), **dict.fromkeys(field_names)))

    def apply_request(self, model: str, body: Mapping[str, object]) -> Thresholds:
        """POST /busy_threshold: any non-null threshold in `body` sets (merging), all null is a get.

        Keys other than the three thresholds (`model` among them) are the server's and ignored here.
        """
        fields: dict[str, Any] = {name: body.get(name) for name in THRESHOLD_FIELDS}
        if all(value is None for value in fields.values()):
            return self.get(model)
        return self.set(model, **fields)  # set validates whatever the body held

    def _store(self, model: str, thresholds: Thresholds) -> Thresholds:
        self._by_model[model] = thresholds
        return thresholds


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One dp rank's load, as the busy checks see it.

    `kv_used_blocks` is None when this observation carries no KV usage: the router's own load
    reports have none, only the worker's do (Dynamo's ActiveLoad). `total_blocks` is the rank's KV
    capacity; unknown (None or 0) it disables the decode check. `max_num_batched_tokens` unknown
    falls back to DEFAULT_MAX_NUM_BATCHED_TOKENS, as in Dynamo.
    """

    active_decode_blocks: int
    active_prefill_tokens: int
    kv_used_blocks: int | None = None
    total_blocks: int | None = None
    max_num_batched_tokens: int | None = None


class BusySignal(StrEnum):
    """What made a rank busy; the values are stable labels (metrics, JSON, refusal messages)."""

    active_prefill_tokens = "active_prefill_tokens"  # prompt tokens queued > the absolute threshold
    active_prefill_tokens_frac = "active_prefill_tokens_frac"  # ... > frac × max_num_batched_tokens
    kv_used_fraction = "kv_used_fraction"  # the worker's reported KV usage > the decode threshold
    active_decode_fraction = "active_decode_fraction"  # the router's active decode blocks > the decode threshold
    decode_latch_held = "decode_latch_held"  # no fresh KV report: the last one, still over, holds the latch


@dataclass(frozen=True, slots=True)
class BusyReason:
    """One check that tripped: `value > threshold` (tokens for prefill signals, fractions of KV for decode)."""

    signal: BusySignal
    value: float
    threshold: float

    def __str__(self) -> str:
        return f"{self.signal} {_number_text(self.value)} > {_number_text(self.threshold)}"


def _number_text(value: float) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True, slots=True)
class RankBusy:
    """A dp rank's verdict: busy exactly when some check tripped, and then `reasons` says which."""

    reasons: tuple[BusyReason, ...] = ()

    @property
    def busy(self) -> bool:
        return bool(self.reasons)


def prefill_reasons(load: WorkerLoad, absolute: int | None, frac: float | None) -> list[BusyReason]:
    """The prefill thresholds a rank's tokens in flight are strictly over (either makes it busy), as the busy
    check and a router queue's policy class (queue.py) both judge them."""
    limits: list[tuple[BusySignal, int]] = []
    if absolute is not None:
        limits.append((BusySignal.active_prefill_tokens, absolute))
    if frac is not None:
        limits.append((BusySignal.active_prefill_tokens_frac, _prefill_limit(frac, load)))
    tokens = load.active_prefill_tokens
    return [BusyReason(signal, tokens, limit) for signal, limit in limits if tokens > limit]


def _prefill_limit(frac: float, load: WorkerLoad) -> int:
    """`frac` of the rank's max_num_batched_tokens, in whole tokens: a rank is over it with more in flight.

    Truncated, as Dynamo's `(frac * max_batched) as u64` (which saturates: so does this, so that no stored frac
    or reported batch size can overflow into a 500)."""
    max_batched = load.max_num_batched_tokens
    if max_batched is None:
        max_batched = DEFAULT_MAX_NUM_BATCHED_TOKENS
    return int(min(frac * max_batched, _U64_MAX))


class BusyTracker:
    """Per-rank busy verdicts, holding the one piece of state they need: the decode latch.

    Dynamo's latch sets when either decode signal (the worker's KV usage, the router's active
    decode blocks, each over total blocks) exceeds the threshold, and clears only once both are
    back at or below it. The router observes its own active decode blocks on every update, so the
    latch is held past that signal only by the KV usage: the worker reports it now and then, and an
    update without a report (kv_used_blocks None) must not clear what the last report set. So the
    latch state is the last KV usage each rank reported, judged against the current threshold and
    capacity (an operator who raises the threshold frees the rank at once; Dynamo keeps the old
    verdict until the next KV report).
    """

    def __init__(self) -> None:
        self._kv_used: dict[WorkerKey, int] = {}

    def update(self, worker: WorkerKey, load: WorkerLoad, thresholds: Thresholds) -> RankBusy:
        """Record `load` for the rank and judge it: busy if any check trips (Dynamo's OR across checks)."""
        if load.kv_used_blocks is not None:
            self._kv_used[worker] = load.kv_used_blocks
        prefill = prefill_reasons(load, thresholds.active_prefill_tokens_threshold,
                                  thresholds.active_prefill_tokens_threshold_frac)
        return RankBusy(tuple(prefill + self._decode_reasons(worker, load, thresholds)))

    def forget(self, worker_id: int) -> None:
        """Drop the latch state of every rank of a worker that left."""
        for worker in [worker for worker in self._kv_used if worker[0] == worker_id]:
            del self._kv_used[worker]

    def _decode_reasons(self, worker: WorkerKey, load: WorkerLoad, thresholds: Thresholds) -> list[BusyReason]:
        threshold = thresholds.active_decode_blocks_threshold
        total = load.total_blocks
        if threshold is None or not total:
            return []
        signals = [(BusySignal.active_decode_fraction, load.active_decode_blocks)]
        kv_used = self._kv_used.get(worker)
        if kv_used is not None:
            fresh = load.kv_used_blocks is not None
            signals.append((BusySignal.kv_used_fraction if fresh else BusySignal.decode_latch_held, kv_used))
        # `used > threshold × total`, Dynamo's exact comparison (strict: at the threshold is not busy).
        return [BusyReason(signal, used / total, threshold) for signal, used in signals if used > threshold * total]


def worker_busy(ranks: Mapping[WorkerKey, RankBusy]) -> dict[int, bool]:
    """Busy per worker id: a worker is busy only when ALL its dp ranks are (one free rank can serve).

    A rank absent from `ranks` counts for nothing: callers pass every rank they know, free or not.
    """
    busy: dict[int, bool] = {}
    for (worker_id, _), rank in ranks.items():
        busy[worker_id] = busy.get(worker_id, True) and rank.busy
    return busy


class AllBusy(Exception):
    """The refusal when every worker of a model is busy (HTTP 503), saying what tripped on each rank.

    `tripped` maps each (worker_id, dp_rank) to its reasons; the message names the loads, the
    model's thresholds and how to change them, since an operator meeting a 503 needs all three.
    """

    def __init__(self, model: str, thresholds: Thresholds, tripped: Mapping[WorkerKey, tuple[BusyReason, ...]]) -> None:
        self.model = model
        self.thresholds = thresholds
        self.tripped = dict(sorted(tripped.items()))
        workers = len({worker_id for worker_id, _ in self.tripped})
        loads = ", ".join(
            f"{reason} on {format_worker(worker)}"
            for worker, reasons in self.tripped.items()
            for reason in reasons
        )
        values = {name: getattr(thresholds, name) for name in THRESHOLD_FIELDS}
        unset = [name for name, value in values.items() if value is None]
        settings = ", ".join(f"{name}={value}" for name, value in values.items() if value is not None) + (
            f" ({', '.join(unset)} unset)" if unset else "")
        super().__init__(
            f"every worker of model {model!r} is busy ({counted(workers, 'worker')}): {loads}; "
            f"thresholds: {settings}; raise the thresholds with `kvctl busy set` or POST /busy_threshold"
        )


def check_admission(model: str, ranks: Mapping[WorkerKey, RankBusy], thresholds: Thresholds) -> None:
    """Raise AllBusy when the model has workers and every one of them is busy; otherwise admit.

    A model with no workers is not refused here: that is a different failure (nothing to route to).
    """
    workers = worker_busy(ranks)
    if workers and all(workers.values()):
        raise AllBusy(model, thresholds, {worker: rank.reasons for worker, rank in ranks.items()})
