"""What an engine stream has seen (`EngineStream.stats`): its counters, frozen into one value for `/v1/status`,
`/metrics` and the tests. Apart from `zmq_source.py`, which keeps the stream's logic, so that readers of the
counters need not load ZMQ."""

from __future__ import annotations

from dataclasses import dataclass

from kvctl.core.names import WorkerKey
from kvctl.server.ingest.schema_seen import SchemaSeen


@dataclass(frozen=True, slots=True)
class StreamStats:
    """A snapshot of one stream's counters (`EngineStream.stats`).

    - `messages`: live messages received (malformed ones included; duplicates included).
    - `batches_applied`: batches (live or replayed) taken in seq order and decoded, events delivered or not;
      `last_seq` is the last of them.
    - `events`: events handed to the sink.
    - `gaps`: gaps detected on the live stream; `lost_batches`: seqs that could not be replayed.
    - `replays_ok` / `replays_failed`: replays that repaired their gap / that timed out or came back
      incomplete (the engine no longer held the range).
    - `duplicates`: live or replayed messages skipped because their seq was already applied.
    - `jumps`: live seqs implausibly far ahead (`JUMP_MAX`), applied without moving the stream's place.
    - `gapped`: some batch was lost since the stream started (or since the last engine restart,
      which clears the worker and so makes the index whole again).
    - `resumed_from`: the seq a restarted router's state dir held for this stream, which it carried on after
      (asking the engine's replay for what came since); None when it started afresh.
    - `last_event_at` / `last_message_at`: the injected clock at the last delivered event / at the
      last live message; None before any.
    """

    worker: WorkerKey
    endpoint: str
    replay_endpoint: str | None
    messages: int
    batches_applied: int
    events: int
    last_seq: int | None
    gaps: int
    replays_ok: int
    replays_failed: int
    lost_batches: int
    restarts: int
    duplicates: int
    jumps: int
    decode_errors: dict[str, int]
    last_event_at: float | None
    last_message_at: float | None
    gapped: bool
    replaying: bool
    resumed_from: int | None
    schema: SchemaSeen
