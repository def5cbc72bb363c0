"""Busy thresholds: the registry's POST semantics, validation, the per-rank checks and the all-busy refusal."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.core.router.busy import (
    DYNAMO_DEFAULTS,
    AllBusy,
    BusyReason,
    BusySignal,
    BusyThresholds,
    BusyTracker,
    RankBusy,
    ThresholdError,
    Thresholds,
    WorkerLoad,
    check_admission,
    worker_busy,
)

DECODE_08 = Thresholds(active_decode_blocks_threshold=0.8)


def signals(rank: RankBusy) -> list[BusySignal]:
    return [reason.signal for reason in rank.reasons]


# --- registry -------------------------------------------------------------------------------------


def test_unconfigured_model_is_disabled_and_not_listed() -> None:
    registry = BusyThresholds()
    assert registry.get("default") == Thresholds(None, None, None)
    assert registry.all() == {}


def test_dynamo_defaults_as_registry_default() -> None:
    registry = BusyThresholds(default=DYNAMO_DEFAULTS)
    assert registry.get("llama").as_dict("llama") == {
        "model": "llama",
        "active_decode_blocks_threshold": 1.0,
        "active_prefill_tokens_threshold": 10_000_000,
        "active_prefill_tokens_threshold_frac": 10.0,
    }


def test_set_merges_and_none_leaves_unchanged() -> None:
    registry = BusyThresholds()
    registry.set("default", active_decode_blocks_threshold=0.8)
    merged = registry.set("default", active_prefill_tokens_threshold=5000, active_decode_blocks_threshold=None)
    assert merged == Thresholds(0.8, 5000, None)
    assert registry.get("default") == merged
    assert registry.all() == {"default": merged}
    assert registry.get("other") == Thresholds()


def test_unset_disables_only_the_named_fields() -> None:
    registry = BusyThresholds()
    registry.set("default", active_decode_blocks_threshold=0.8, active_prefill_tokens_threshold=5000)
    assert registry.unset("default", "active_decode_blocks_threshold") == Thresholds(None, 5000, None)
    assert registry.get("default") == Thresholds(None, 5000, None)


@pytest.mark.parametrize("call", ["set", "unset"])
def test_unknown_field_name_is_refused(call: str) -> None:
    registry = BusyThresholds()
    with pytest.raises(ThresholdError) as info:
        if call == "set":
            registry.set("default", busy_threshold=0.5)
        else:
            registry.unset("default", "busy_threshold")
    assert info.value.field == "busy_threshold"
    assert "active_prefill_tokens_threshold_frac" in str(info.value)  # lists the valid names
    assert registry.all() == {}


def test_invalid_set_stores_nothing() -> None:
    registry = BusyThresholds()
    registry.set("default", active_prefill_tokens_threshold=5000)
    with pytest.raises(ThresholdError):
        registry.set("default", active_decode_blocks_threshold=1.5, active_prefill_tokens_threshold=9000)
    assert registry.get("default") == Thresholds(None, 5000, None)


def test_apply_request_all_null_is_a_get() -> None:
    registry = BusyThresholds()
    registry.set("a", active_prefill_tokens_threshold=5000)
    body = {"model": "a", "active_decode_blocks_threshold": None, "active_prefill_tokens_threshold": None}
    assert registry.apply_request("a", body) == Thresholds(None, 5000, None)
    assert registry.apply_request("b", {"model": "b"}) == Thresholds()
    assert registry.all() == {"a": Thresholds(None, 5000, None)}  # the get stored nothing for "b"


def test_apply_request_partial_update_keeps_the_others() -> None:
    registry = BusyThresholds()
    registry.set("a", active_decode_blocks_threshold=0.9, active_prefill_tokens_threshold=5000)
    body = {"model": "a", "active_prefill_tokens_threshold_frac": 2, "active_decode_blocks_threshold": None}
    updated = registry.apply_request("a", body)
    assert updated.as_dict("a") == {
        "model": "a",
        "active_decode_blocks_threshold": 0.9,
        "active_prefill_tokens_threshold": 5000,
        "active_prefill_tokens_threshold_frac": 2.0,
    }
    assert registry.get("a") == updated


def test_apply_request_validates_the_body() -> None:
    registry = BusyThresholds()
    with pytest.raises(ThresholdError) as info:
        registry.apply_request("a", {"active_decode_blocks_threshold": 2})
    assert info.value.field == "active_decode_blocks_threshold"


def test_as_dict_writes_null_and_float_fractions() -> None:
    assert Thresholds(1, None, 0).as_dict("m") == {
        "model": "m",
        "active_decode_blocks_threshold": 1.0,
        "active_prefill_tokens_threshold": None,
        "active_prefill_tokens_threshold_frac": 0.0,
    }
    assert type(Thresholds(1).active_decode_blocks_threshold) is float


# --- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 1, 0.0, 0.5, 1.0])
def test_decode_fraction_accepted(value: float) -> None:
    assert Thresholds(active_decode_blocks_threshold=value).active_decode_blocks_threshold == value


@pytest.mark.parametrize("value", [-0.1, 1.5, math.nan, math.inf, True, "0.5"])
def test_decode_fraction_rejected(value: object) -> None:
    with pytest.raises(ThresholdError) as info:
        Thresholds(active_decode_blocks_threshold=value)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)  # what the server maps to 400
    assert info.value.field == "active_decode_blocks_threshold"
    assert str(info.value).startswith("active_decode_blocks_threshold must be a number in [0.0, 1.0]")
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("value", [0, 10_000, 2**64 - 1])
def test_prefill_tokens_accepted(value: int) -> None:
    assert Thresholds(active_prefill_tokens_threshold=value).active_prefill_tokens_threshold == value


@pytest.mark.parametrize("value", [-1, 2**64, 10_000.0, True, "5000"])
def test_prefill_tokens_rejected(value: object) -> None:
    with pytest.raises(ThresholdError, match=r"^active_prefill_tokens_threshold must be an integer in \[0, 2\^64-1\]"):
        Thresholds(active_prefill_tokens_threshold=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0, 0.5, 10.0, 1000])
def test_prefill_frac_accepted(value: float) -> None:
    assert Thresholds(active_prefill_tokens_threshold_frac=value).active_prefill_tokens_threshold_frac == value


@pytest.mark.parametrize("value", [-0.5, math.inf, math.nan, 10**400, 1e308, 1_000_001])
def test_prefill_frac_rejected(value: float) -> None:
    wanted = r"^active_prefill_tokens_threshold_frac must be a number in \[0\.0, 1e\+06\]"
    with pytest.raises(ThresholdError, match=wanted):
        Thresholds(active_prefill_tokens_threshold_frac=value)


def test_a_stored_frac_too_large_for_a_token_count_saturates() -> None:
    """A frac stored past today's checks (an older version's snapshot, say) must not turn into an exception."""
    thresholds = Thresholds(active_prefill_tokens_threshold_frac=1.0)
    object.__setattr__(thresholds, "active_prefill_tokens_threshold_frac", 1e308)
    assert not BusyTracker().update((7, 0), WorkerLoad(0, 2**63), thresholds).busy


# --- prefill checks -------------------------------------------------------------------------------


@pytest.mark.parametrize(("tokens", "busy"), [(10_000, False), (10_001, True)])
def test_prefill_absolute_threshold_is_strict(tokens: int, busy: bool) -> None:
    rank = BusyTracker().update((7, 0), WorkerLoad(0, tokens), Thresholds(active_prefill_tokens_threshold=10_000))
    assert rank.busy is busy
    assert rank.reasons == ((BusyReason(BusySignal.active_prefill_tokens, 10_001, 10_000),) if busy else ())


@pytest.mark.parametrize(
    ("max_batched", "frac", "tokens", "limit"),
    [
        (8192, 0.5, 4096, None),  # at the limit: free
        (8192, 0.5, 4097, 4096),
        (8191, 0.5, 4096, 4095),  # 4095.5 truncated to 4095, as Dynamo's `as u64`
        (None, 0.001, 10_000, None),  # no max_num_batched_tokens: 0.001 × 10M = 10000
        (None, 0.001, 10_001, 10_000),
    ],
)
def test_prefill_frac_threshold(max_batched: int | None, frac: float, tokens: int, limit: int | None) -> None:
    load = WorkerLoad(0, tokens, max_num_batched_tokens=max_batched)
    rank = BusyTracker().update((7, 0), load, Thresholds(active_prefill_tokens_threshold_frac=frac))
    expected = () if limit is None else (BusyReason(BusySignal.active_prefill_tokens_frac, tokens, limit),)
    assert rank.reasons == expected


def test_every_tripped_check_is_reported() -> None:
    thresholds = Thresholds(0.5, 1000, 1.0)
    load = WorkerLoad(
        active_decode_blocks=60, active_prefill_tokens=9000, total_blocks=100, max_num_batched_tokens=8192
    )
    rank = BusyTracker().update((7, 0), load, thresholds)
    assert signals(rank) == [
        BusySignal.active_prefill_tokens,
        BusySignal.active_prefill_tokens_frac,
        BusySignal.active_decode_fraction,
    ]


def test_no_thresholds_never_busy() -> None:
    load = WorkerLoad(10**6, 10**9, kv_used_blocks=10**6, total_blocks=10, max_num_batched_tokens=1)
    assert not BusyTracker().update((7, 0), load, Thresholds()).busy


# --- decode latch ---------------------------------------------------------------------------------


def test_kv_usage_sets_the_latch_strictly_above_the_threshold() -> None:
    tracker = BusyTracker()
    assert not tracker.update((7, 0), WorkerLoad(0, 0, kv_used_blocks=80, total_blocks=100), DECODE_08).busy
    rank = tracker.update((7, 0), WorkerLoad(0, 0, kv_used_blocks=81, total_blocks=100), DECODE_08)
    assert rank.reasons == (BusyReason(BusySignal.kv_used_fraction, 0.81, 0.8),)
    assert str(rank.reasons[0]) == "kv_used_fraction 0.81 > 0.8"


def test_latch_holds_while_one_signal_is_above_and_clears_when_both_drop() -> None:
    tracker = BusyTracker()

    def update(decode: int, kv: int | None) -> list[BusySignal]:
        return signals(tracker.update((7, 0), WorkerLoad(decode, 0, kv_used_blocks=kv, total_blocks=100), DECODE_08))

    assert update(decode=10, kv=90) == [BusySignal.kv_used_fraction]  # set by the worker's KV report
    assert update(decode=10, kv=None) == [BusySignal.decode_latch_held]  # a router update: no report, held
    assert update(decode=85, kv=50) == [BusySignal.active_decode_fraction]  # KV back down, decode still above
    assert update(decode=85, kv=None) == [BusySignal.active_decode_fraction]
    assert update(decode=80, kv=None) == []  # both at or below 0.8: cleared
    assert update(decode=10, kv=None) == []


def test_unknown_capacity_disables_the_decode_check() -> None:
    tracker = BusyTracker()
    for total in (None, 0):
        assert not tracker.update((7, 0), WorkerLoad(500, 0, kv_used_blocks=500, total_blocks=total), DECODE_08).busy


def test_raising_the_threshold_frees_a_latched_rank() -> None:
    tracker = BusyTracker()
    assert tracker.update((7, 0), WorkerLoad(0, 0, kv_used_blocks=90, total_blocks=100), DECODE_08).busy
    raised = Thresholds(active_decode_blocks_threshold=0.95)
    assert not tracker.update((7, 0), WorkerLoad(0, 0, total_blocks=100), raised).busy


def test_forget_drops_every_rank_of_the_worker_only() -> None:
    tracker = BusyTracker()
    for worker in [(7, 0), (7, 1), (8, 0)]:
        tracker.update(worker, WorkerLoad(0, 0, kv_used_blocks=90, total_blocks=100), DECODE_08)
    tracker.forget(7)
    no_report = WorkerLoad(0, 0, total_blocks=100)
    assert [tracker.update(w, no_report, DECODE_08).busy for w in [(7, 0), (7, 1), (8, 0)]] == [False, False, True]


def dynamo_latch(observations: list[tuple[int, int | None]], threshold: float, total: int) -> list[bool]:
    """Dynamo's DecodeOverloadLatchState, step by step: set when either signal is over; clear when both
    have been seen back at or below. An observation without a KV report leaves the KV verdict as it was."""
    latched, kv_cleared, states = False, True, []
    for decode, kv in observations:
        decode_over = decode > threshold * total
        kv_over = kv is not None and kv > threshold * total
        latched = latched or decode_over or kv_over
        if kv is not None:
            kv_cleared = not kv_over
        if latched and kv_cleared and not decode_over:
            latched = False
        states.append(latched)
    return states


@settings(max_examples=300, deadline=None)
@given(
    threshold=st.floats(0.0, 1.0),
    total=st.integers(1, 200),
    observations=st.lists(st.tuples(st.integers(0, 250), st.none() | st.integers(0, 250)), max_size=30),
)
def test_latch_matches_dynamo_reference(
    threshold: float, total: int, observations: list[tuple[int, int | None]]
) -> None:
    tracker = BusyTracker()
    thresholds = Thresholds(active_decode_blocks_threshold=threshold)
    busy = [
        tracker.update((3, 1), WorkerLoad(decode, 0, kv_used_blocks=kv, total_blocks=total), thresholds).busy
        for decode, kv in observations
    ]
    assert busy == dynamo_latch(observations, threshold, total)


# --- workers and admission ------------------------------------------------------------------------

BUSY = RankBusy((BusyReason(BusySignal.active_prefill_tokens, 12_000, 10_000),))
FREE = RankBusy()


def test_worker_is_busy_only_when_all_its_ranks_are() -> None:
    ranks = {(1, 0): BUSY, (1, 1): FREE, (2, 0): BUSY, (2, 1): BUSY, (3, 0): FREE}
    assert worker_busy(ranks) == {1: False, 2: True, 3: False}


def test_no_workers_is_not_a_busy_refusal() -> None:
    check_admission("default", {}, DECODE_08)


def test_one_free_rank_admits() -> None:
    check_admission("default", {(7, 0): BUSY, (8, 0): BUSY, (8, 1): FREE}, DECODE_08)


def test_all_busy_names_the_loads_and_thresholds() -> None:
    thresholds = Thresholds(0.8, 10_000, None)
    tracker = BusyTracker()
    ranks = {
        (8, 1): tracker.update((8, 1), WorkerLoad(10, 0, kv_used_blocks=90, total_blocks=100), thresholds),
        (7, 0): tracker.update((7, 0), WorkerLoad(0, 12_000, total_blocks=100), thresholds),
    }
    with pytest.raises(AllBusy) as info:
        check_admission("default", ranks, thresholds)
    refusal = info.value
    assert refusal.model == "default"
    assert refusal.thresholds == thresholds
    assert refusal.tripped == {
        (7, 0): (BusyReason(BusySignal.active_prefill_tokens, 12_000, 10_000),),
        (8, 1): (BusyReason(BusySignal.kv_used_fraction, 0.9, 0.8),),
    }
    assert str(refusal) == (
        "every worker of model 'default' is busy (2 workers): "
        "active_prefill_tokens 12000 > 10000 on 7:0, kv_used_fraction 0.9 > 0.8 on 8:1; "
        "thresholds: active_decode_blocks_threshold=0.8, active_prefill_tokens_threshold=10000 "
        "(active_prefill_tokens_threshold_frac unset); "
        "raise the thresholds with `kvctl busy set` or POST /busy_threshold"
    )
