"""Router state on disk: written atomically on shutdown and every snapshot interval, restored on start.

Format (JSON lines, `kvctl.snapshot/v1`): a header line `{"schema", "taken_at", "models": {name:
block_size}, "workers": [...]}`, then one `{"model": name, "event": RouterEvent}` line per dumped
event, so a snapshot is also readable by `jq` and by anything that reads Dynamo's RouterEvent JSON.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvctl.core.events.dynamo import decode_router_event_json, encode_router_event_json
from kvctl.core.events.errors import DecodeError
from kvctl.core.index.kv_index import DumpEdge, events_of
from kvctl.server.state import Fleet, WorkerInfo

SCHEMA = "kvctl.snapshot/v1"
FILENAME = "snapshot.jsonl"


class SnapshotError(Exception):
    pass


@dataclass(frozen=True, slots=True)
class Restored:
    taken_at: float
    events: int
    rejected: int


@dataclass(frozen=True, slots=True)
class Capture:
    """A fleet's state taken in one step on the event loop; encoding and writing it can happen anywhere."""

    header: dict[str, Any]
    models: list[tuple[str, list[DumpEdge]]]


def capture(fleet: Fleet, taken_at: float) -> Capture:
    header = {
        "schema": SCHEMA,
        "taken_at": taken_at,
        "models": {name: state.block_size for name, state in sorted(fleet.models.items())},
        "workers": [{"worker_id": i.worker_id, "dp_rank": i.dp_rank, "model": i.model, "endpoint": i.endpoint,
                     "replay_endpoint": i.replay_endpoint, "topic": i.topic} for i in fleet.workers.values()],
    }
    return Capture(header, [(name, state.router.index.capture()) for name, state in sorted(fleet.models.items())])


def _lines(taken: Capture) -> Iterator[bytes]:
    yield json.dumps(taken.header).encode() + b"\n"
    for name, edges in taken.models:
        prefix = b'{"model":' + json.dumps(name).encode() + b',"event":'
        for event in events_of(edges):
            yield prefix + encode_router_event_json(event) + b"}\n"


def write(taken: Capture, state_dir: Path) -> Path:
    """Write to a temporary file in the same directory, fsync, then rename over the old snapshot.

    Touches nothing but `taken`, so it may run in a thread while the loop goes on.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / FILENAME
    tmp = state_dir / f".{FILENAME}.{os.getpid()}.tmp"
    with tmp.open("wb") as f:
        f.writelines(_lines(taken))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def restore(fleet: Fleet, state_dir: Path, now: float) -> Restored | None:
    """Load the snapshot into an empty fleet; None when there is none. A damaged file raises SnapshotError."""
    path = state_dir / FILENAME
    if not path.exists():
        return None
    with path.open("rb") as f:
        try:
            header = json.loads(f.readline())
        except ValueError as exc:
            raise SnapshotError(f"{path}: unreadable header ({exc})") from None
        if not isinstance(header, dict) or header.get("schema") != SCHEMA:
            raise SnapshotError(f"{path}: not a {SCHEMA} snapshot")
        for name, block_size in header["models"].items():
            fleet.add_model(name, block_size=block_size)
        for w in header["workers"]:
            fleet.register(WorkerInfo(w["worker_id"], w["dp_rank"], w["model"], w["endpoint"],
                                      w["replay_endpoint"], w["topic"]))
        events = rejected = 0
        for n, line in enumerate(f, 2):
            try:
                item = json.loads(line)
                event = decode_router_event_json(item["event"])
            except (ValueError, KeyError, TypeError, DecodeError) as exc:
                raise SnapshotError(f"{path}:{n}: {exc}") from None
            applied, bad = fleet.apply(item["model"], [event], now)
            events += applied
            rejected += sum(bad.values())
    return Restored(header["taken_at"], events, rejected)


def delete(state_dir: Path) -> bool:
    path = state_dir / FILENAME
    if path.exists():
        path.unlink()
        return True
    return False
