"""The router queue's verdict (Dynamo 1.6.1's `--router-queue-threshold`, and the policy classes of
`--router-policy-config`): when the frontend would hold a request."""

from __future__ import annotations

import math

import pytest

from kvctl.core.router.busy import DEFAULT_MAX_NUM_BATCHED_TOKENS, WorkerLoad
from kvctl.core.router.policy_classes import PolicyClass, synthetic
from kvctl.core.router.queue import QueuePolicy, RouterQueue, would_queue

A, B = (1, 0), (2, 0)


def _load(prefill: int, max_batched: int | None = 1000) -> WorkerLoad:
    return WorkerLoad(0, prefill, max_num_batched_tokens=max_batched)


def _flags(threshold: float, policy: QueuePolicy = QueuePolicy.fcfs) -> PolicyClass:
    """The one class the deprecated flags make."""
    return synthetic(RouterQueue(threshold, policy)).classes[0]


def test_a_request_queues_only_when_every_rank_is_over_its_limit() -> None:
    queue = _flags(0.5, QueuePolicy.wspt)
    assert would_queue(queue, {A: _load(501), B: _load(500)}) is None  # at the limit is not over it
    verdict = would_queue(queue, {A: _load(501), B: _load(9000, max_batched=2000)})
    assert verdict is not None and verdict.policy_class is queue and queue.name == "default"
    assert {w: str(r) for w, r in verdict.over.items()} == {A: "active_prefill_tokens_frac 501 > 500",
                                                            B: "active_prefill_tokens_frac 9000 > 1000"}


def test_threshold_zero_queues_once_every_rank_has_prefill_in_flight() -> None:
    queue = _flags(0.0)
    assert would_queue(queue, {A: _load(1), B: _load(0)}) is None
    assert would_queue(queue, {A: _load(1), B: _load(1, max_batched=None)}) is not None
    assert would_queue(queue, {}) is None  # no rank: nothing to wait for (routing says there is no worker)


def test_a_rank_that_never_said_its_batch_size_is_judged_against_dynamos_default() -> None:
    queue = _flags(1.0)
    assert would_queue(queue, {A: _load(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_batched=None)}) is None
    assert would_queue(queue, {A: _load(DEFAULT_MAX_NUM_BATCHED_TOKENS + 1, max_batched=None)}) is not None


@pytest.mark.parametrize("threshold", [-0.1, math.inf, math.nan, True])
def test_the_threshold_is_a_finite_number_at_least_zero(threshold: float) -> None:
    with pytest.raises(ValueError, match="router queue threshold"):
        RouterQueue(threshold)


def test_a_class_holds_past_either_threshold_and_without_one_never() -> None:
    both = PolicyClass("c", prefill_busy_threshold=100, prefill_busy_threshold_frac=0.5)
    assert would_queue(both, {A: _load(101, max_batched=1000)}) is not None  # over 100 tokens, under 500
    assert would_queue(both, {A: _load(100, max_batched=150)}) is not None  # under 100 tokens, over 75
    assert would_queue(both, {A: _load(100, max_batched=1000)}) is None  # at 100, under 500: not over either
    verdict = would_queue(both, {A: _load(101), B: _load(600)})
    assert verdict is not None and {w: str(r) for w, r in verdict.over.items()} == {
        A: "active_prefill_tokens 101 > 100", B: "active_prefill_tokens 600 > 100"}
    assert would_queue(PolicyClass("never"), {A: _load(10**9)}) is None
