"""How the fleet's things are named, in one place: a worker is the (worker_id, dp_rank) pair Dynamo keys its index
by, written `ID:DP` wherever a person reads or types it, and a request that names no model means `default`."""

from __future__ import annotations

import re
from collections.abc import Mapping
from enum import StrEnum
from typing import TypeAlias

from kvctl.core.words import counted

WorkerKey: TypeAlias = tuple[int, int]
"""(worker_id, dp_rank): a plain tuple, as the index and the native extension build them on the hot path."""

StreamId: TypeAlias = tuple[WorkerKey, str]
"""An engine stream: the worker it is registered as and the endpoint it reads. Its seqs are that publisher's
alone: another endpoint for the same worker numbers its batches afresh."""

SeqMark: TypeAlias = tuple[StreamId, int]
"""A batch's place in its engine stream: what a restart resumes that stream after (`Fleet.stream_seqs`)."""

WorkerSelector: TypeAlias = tuple[int, int | None]
"""(worker_id, dp_rank or None): `ID` selects every rank of a worker, `ID:DP` one of them."""

DEFAULT_MODEL = "default"
"""The model of a request, event or worker that names none: what a single-model router serves."""

class Role(StrEnum):
    """A worker's part in serving its model (its model card's worker_type): a disaggregated fleet splits each
    request between a prefill pool and a decode pool, and Dynamo picks from each apart."""

    aggregated = "aggregated"
    prefill = "prefill"
    decode = "decode"


DEFAULT_BLOCK_SIZE = 16
"""Tokens per KV block of a model given none (vLLM's default on GPU, and kvctl's since its start)."""



def implied_model(workers_by_model: Mapping[str, int]) -> tuple[str, str | None]:
    """The model a command means when it names none, and a note when that needs saying: `default` where it has
    workers (or nothing has), else the router's one model with workers; with several, `default` and the note
    naming them, since an empty answer about `default` would otherwise read as "the router lost everything"."""
    serving = {m: n for m, n in sorted(workers_by_model.items()) if n}
    if DEFAULT_MODEL in serving or not serving:
        return DEFAULT_MODEL, None
    if len(serving) == 1:
        return next(iter(serving)), None
    listed = ", ".join(f"{m} ({counted(n, 'worker')})" for m, n in serving.items())
    return DEFAULT_MODEL, f"model {DEFAULT_MODEL!r} has no workers; models with workers: {listed}; pass -m MODEL"


MAX_WORKER_ID = 2**64 - 1  # Dynamo's worker ids are u64
MAX_DP_RANK = 2**32 - 1  # and its data-parallel ranks u32
MAX_REQUEST_ID_CHARS = 256
"""Longest request id taken from another router (held as long as its booking): Dynamo's are UUIDs, 36 characters."""

# ASCII digits only: int() alone would also take "+3", "1_0", "3: 1" and other scripts' digits. A sign, and up
# to 20 digits (2^64 has 20), are let through to the range checks, which say what the id or rank should be.
_ID_DP = re.compile(r"(-?[0-9]{1,20})(?::(-?[0-9]{1,20}))?")


def format_worker(worker: WorkerKey) -> str:
    """`ID:DP`, as the API's keys, the tables and the logs write a worker."""
    return f"{worker[0]}:{worker[1]}"


def parse_worker(text: str) -> WorkerSelector:
    """`ID` or `ID:DP` as (worker_id, dp_rank or None); ValueError, saying what was wanted, for anything else."""
    m = _ID_DP.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"a worker is ID or ID:DP (integers), got {text!r}")
    worker_id, dp_rank = int(m[1]), (None if m[2] is None else int(m[2]))
    if not 0 <= worker_id <= MAX_WORKER_ID:
        raise ValueError(f"worker {text!r}: a worker id is 0..2^64-1")
    if dp_rank is not None and not 0 <= dp_rank <= MAX_DP_RANK:
        raise ValueError(f"worker {text!r}: a dp rank is 0..2^32-1")
    return worker_id, dp_rank


def selects(selector: WorkerSelector, worker: WorkerKey) -> bool:
    """Whether `ID` (every rank) or `ID:DP` (that rank) names this worker."""
    worker_id, dp_rank = selector
    return worker[0] == worker_id and (dp_rank is None or worker[1] == dp_rank)
