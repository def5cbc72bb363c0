"""Router state on disk: the image of the whole index, written atomically, restored on start.

The state log (`kvctl.server.persistence`) holds what changed since an image, and a child process folds it
into the next image; approximate mode, whose index changes with every route, writes an image every
snapshot interval and on shutdown instead.

Format (JSON lines, `kvctl.snapshot/v2`): a header line `{"schema", "taken_at", "models": {name:
block_size}, "workers": [...]}`, one `{"model": name, "event": RouterEvent}` line per dumped event,
so a snapshot is also readable by `jq` and by anything that reads Dynamo's RouterEvent JSON, then a
trailer `{"end": {"lines": N, "sha256": hex}}` over every line before it. v1 files (no trailer) load.

A crash can interrupt a write anywhere, and a disk can rot, so the state dir keeps two snapshots: the
newest and the one before (`snapshot.jsonl.prev`). A file's trailer and checksum are checked, then every
line of it decoded into typed records and validated, before anything of it is applied; one that fails
either check is moved aside as `.damaged` and the other one is used, or none: never a mix of the two.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import groupby
from operator import itemgetter
from pathlib import Path
from typing import Annotated, Any

import msgspec

from kvctl.core.events import RouterEvent
from kvctl.core.events.dynamo import decode_router_event_json, encode_router_event_json
from kvctl.core.events.errors import DecodeError
from kvctl.core.index.kv_index import DumpEdge, events_of
from kvctl.errors import SnapshotError
from kvctl.server.ingest.endpoint import check_endpoint
from kvctl.server.state import Fleet, WorkerInfo

SCHEMA = "kvctl.snapshot/v2"
SCHEMAS = ("kvctl.snapshot/v1", SCHEMA)  # v1: no trailer, so no checksum
FILENAME = "snapshot.jsonl"
PREVIOUS = FILENAME + ".prev"


@dataclass(frozen=True, slots=True)
class Restored:
    taken_at: float
    events: int
    rejected: int
    path: Path  # the newest snapshot, or the previous one when the newest was damaged
    log_from: int = 0  # the first state-log segment it does not hold (`persistence.segments`)


@dataclass(frozen=True, slots=True)
class Capture:
    """A fleet's state taken in one step on the event loop; encoding and writing it can happen anywhere."""

    header: dict[str, Any]
    models: list[tuple[str, list[DumpEdge]]]
    number: int = 0  # the order captures were taken in (`Writer`)


def capture(fleet: Fleet, taken_at: float, number: int = 0, log_from: int = 0) -> Capture:
    header = {
        "schema": SCHEMA,
        "taken_at": taken_at,
        "log_from": log_from,
        "models": {name: state.block_size for name, state in sorted(fleet.models.items())},
        "workers": [{"worker_id": i.worker_id, "dp_rank": i.dp_rank, "model": i.model, "endpoint": i.endpoint,
                     "replay_endpoint": i.replay_endpoint, "topic": i.topic} for i in fleet.workers.values()],
    }
    return Capture(header, [(name, state.router.index.capture()) for name, state in sorted(fleet.models.items())],
                   number)


class Writer:
    """The one writer of a state dir's snapshots, shared by the periodic task and the final snapshot.

    Writes share one temporary file, and cancelling a task does not stop its thread, so they are taken
    one at a time: the final snapshot waits for a periodic write in flight, and a capture older than
    one already written is dropped rather than put back over it.
    """

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self._lock = threading.Lock()
        self._numbers = itertools.count(1)
        self._written = 0

    def capture(self, fleet: Fleet, taken_at: float) -> Capture:
        """On the event loop: the fleet in one step, numbered."""
        return capture(fleet, taken_at, next(self._numbers))

    def write(self, taken: Capture) -> Path | None:
        """Write `taken` (any thread); None when a newer capture is already on disk."""
        with self._lock:
            if taken.number <= self._written:
                return None
            path = write(taken, self.state_dir)
            self._written = taken.number
            return path


def _lines(taken: Capture) -> Iterator[bytes]:
    yield json.dumps(taken.header).encode() + b"\n"
    for name, edges in taken.models:
        prefix = b'{"model":' + json.dumps(name).encode() + b',"event":'
        for event in events_of(edges):
            yield prefix + encode_router_event_json(event) + b"}\n"


def _with_trailer(lines: Iterator[bytes]) -> Iterator[bytes]:
    digest, count = hashlib.sha256(), 0
    for line in lines:
        digest.update(line)
        count += 1
        yield line
    yield json.dumps({"end": {"lines": count, "sha256": digest.hexdigest()}}).encode() + b"\n"


def write(taken: Capture, state_dir: Path) -> Path:
    """Write to a temporary file in the same directory and fsync it; then the current snapshot becomes
    the previous one and the new file takes its name, and the directory is fsynced.

    A crash before the first rename leaves both snapshots as they were; between the renames, only the
    previous one (which restore falls back to). Touches nothing but `taken`, so it may run in a thread.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / FILENAME
    tmp = state_dir / f".{FILENAME}.{os.getpid()}.tmp"
    for stale in state_dir.glob(f".{FILENAME}.*.tmp"):  # left by a process killed mid-write
        if stale != tmp:
            stale.unlink(missing_ok=True)
    try:
        with tmp.open("wb") as f:
            f.writelines(_with_trailer(_lines(taken)))
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk must not keep a half file around
        raise
    if path.exists():
        os.replace(path, state_dir / PREVIOUS)
    os.replace(tmp, path)
    fsync_dir(state_dir)
    return path


def fsync_dir(directory: Path) -> None:
    """Make the renames durable: without it a power loss may bring back the directory as it was."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def restore(fleet: Fleet, state_dir: Path, now: float) -> tuple[Restored | None, list[str]]:
    """Load the newest sound snapshot into an empty fleet. Returns it (None when there is none) and the
    problems found on the way: each damaged file is named and moved aside.

    A file is checked whole (trailer, checksum, then every line decoded and validated) before any of it
    is applied, so one bad line anywhere means the previous file or an empty start, never a mix."""
    problems: list[str] = []
    for path in (state_dir / FILENAME, state_dir / PREVIOUS):
        if not path.exists():
            continue
        try:
            contents = _read(path)
        except SnapshotError as exc:
            problems.append(f"{exc.message} ({_move_aside(path)})")
            continue
        return _apply(fleet, contents, now), problems
    return None, problems


def _move_aside(path: Path) -> str:
    """Keep a damaged file for a post-mortem, out of the next start's way; a start never fails on it."""
    aside = path.with_name(f"{path.name}.damaged")
    try:
        os.replace(path, aside)
    except OSError as exc:
        return f"could not move it aside to {aside.name}: {exc.strerror or exc}"
    return f"moved to {aside.name}"


def _verify(path: Path) -> tuple[dict[str, Any], int]:
    """The header and the number of event lines after it, once the file is whole: one streaming pass,
    so a snapshot of a large index is never held in memory."""
    digest, hashed, pending = hashlib.sha256(), 0, None  # pending: the newest line, maybe the trailer
    try:
        with path.open("rb") as f:
            first = f.readline()
            digest.update(first)
            hashed = 1
            for line in f:
                if pending is not None:
                    digest.update(pending)
                    hashed += 1
                pending = line
    except OSError as exc:
        raise SnapshotError(f"{path}: unreadable ({exc.strerror})") from None
    try:
        header = json.loads(first)
    except ValueError as exc:
        raise SnapshotError(f"{path}: unreadable header ({exc})") from None
    if not isinstance(header, dict) or header.get("schema") not in SCHEMAS:
        raise SnapshotError(f"{path}: not a kvctl snapshot ({', '.join(SCHEMAS)})")
    if header["schema"] != SCHEMA:  # v1: no trailer to check
        return header, hashed - 1 + (pending is not None)
    try:
        end = json.loads(pending or b"")["end"]
        expected_lines, expected_sha = int(end["lines"]), str(end["sha256"])
    except (ValueError, KeyError, TypeError):
        raise SnapshotError(f"{path}: no trailer: the write was cut short") from None
    if hashed != expected_lines or digest.hexdigest() != expected_sha:
        raise SnapshotError(f"{path}: checksum mismatch: the file changed after it was written")
    return header, hashed - 1


U32 = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
Name = Annotated[str, msgspec.Meta(min_length=1)]


class _Worker(msgspec.Struct):
    worker_id: Annotated[int, msgspec.Meta(ge=0)]  # and < 2**64: msgspec bounds stop at int64
    dp_rank: U32
    model: Name
    endpoint: str | None = None
    replay_endpoint: str | None = None
    topic: str = ""


class _Header(msgspec.Struct):
    """What a header must hold for the fleet to take it: the types `capture` writes, in their ranges."""

    schema: str
    taken_at: Annotated[float, msgspec.Meta(ge=0, lt=1e11)]  # epoch seconds: NaN and inf are refused
    models: dict[Name, Annotated[int, msgspec.Meta(ge=1, lt=2**32)]]
    workers: list[_Worker]
    log_from: Annotated[int, msgspec.Meta(ge=0)] = 0  # absent before the state log


class _Line(msgspec.Struct):
    model: Name
    event: dict[str, Any]


@dataclass(frozen=True, slots=True)
class _Contents:
    path: Path
    header: _Header
    events: list[tuple[str, RouterEvent]]


def _read(path: Path) -> _Contents:
    """The whole file, checked and decoded into typed records; SnapshotError naming the first problem."""
    raw, body_lines = _verify(path)
    try:
        header = msgspec.convert(raw, _Header)
        for w in header.workers:
            if w.worker_id >= 2**64:
                raise ValueError(f"worker_id {w.worker_id} is not a u64")
            if w.model not in header.models:
                raise ValueError(f"worker {w.worker_id}'s model {w.model!r} is not among the models")
            for endpoint in (w.endpoint, w.replay_endpoint):
                if endpoint is not None:
                    check_endpoint(endpoint)
    except (msgspec.ValidationError, ValueError) as exc:
        raise SnapshotError(f"{path}:1: bad header: {exc}") from None
    events: list[tuple[str, RouterEvent]] = []
    with path.open("rb") as f:
        f.readline()
        for n, line in zip(range(2, body_lines + 2), f, strict=False):
            try:
                item = msgspec.json.decode(line, type=_Line)
                if item.model not in header.models:
                    raise ValueError(f"model {item.model!r} is not among the header's models")
                events.append((item.model, decode_router_event_json(item.event)))
            except (msgspec.DecodeError, ValueError, DecodeError) as exc:
                raise SnapshotError(f"{path}:{n}: {exc}") from None
    return _Contents(path, header, events)


def _apply(fleet: Fleet, contents: _Contents, now: float) -> Restored:
    """Every record of a file `_read` accepted: nothing here can fail half way."""
    header = contents.header
    for name, block_size in header.models.items():
        fleet.add_model(name, block_size=block_size)
    for w in header.workers:
        fleet.register(WorkerInfo(w.worker_id, w.dp_rank, w.model, w.endpoint, w.replay_endpoint, w.topic))
    events = rejected = 0
    for model, run in groupby(contents.events, key=itemgetter(0)):
        applied, bad = fleet.apply(model, (event for _, event in run), now)
        events += applied
        rejected += sum(bad.values())
    return Restored(header.taken_at, events, rejected, contents.path, header.log_from)


def delete(state_dir: Path) -> bool:
    """Delete both snapshots and the state log after them; True when there was one."""
    found = False
    for path in (state_dir / FILENAME, state_dir / PREVIOUS, *state_dir.glob("state.log.*")):
        if path.exists():
            path.unlink()
            found = True
    return found
