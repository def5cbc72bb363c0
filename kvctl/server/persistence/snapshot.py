"""Router state on disk: the image of the whole index, written atomically, restored on start.

The state log (`kvctl.server.persistence`) holds what changed since an image, and a child process folds it
into the next image; approximate mode, whose index changes with every route, writes an image every
snapshot interval and on shutdown instead.

Format (`kvctl.snapshot/v3`): a JSON header line `{"schema", "taken_at", "log_from", "log_pos", "models": {name:
block_size}, "workers": [...], "seqs": [...], "indexes": {...}}` (`seqs`: each engine stream's last seq the
image holds, where a restart resumes it; `log_pos`: how many of the state dir's changes it holds, the position
the state log's marks go on from; both absent in older files), then each model's index as binary runs of
nodes, built back in bulk on restore, and a checksummed trailer (`tree_image`). Images written before still
load: v2 (JSON lines, one `{"model": name, "event": RouterEvent}` line per dumped event, then a trailer
`{"end": {"lines": N, "sha256": hex}}` over every line before it), replayed event by event, and v1 (no trailer).

A crash can interrupt a write anywhere, and a disk can rot, so the state dir keeps two snapshots: the
newest and the one before (`snapshot.jsonl.prev`). A file's trailer and checksum are checked, then every
line of it decoded into typed records and validated, before anything of it is applied; one that fails
either check is moved aside as `.damaged` and the other one is used, or none: never a mix of the two.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import threading
from array import array
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NamedTuple, TypeVar

import msgspec

from kvctl.core.events import RouterEvent, Stored, Tier
from kvctl.core.events.dynamo import decode_router_event_json
from kvctl.core.events.errors import DecodeError
from kvctl.core.index import bulk
from kvctl.core.index.kv_index import DumpEdge
from kvctl.core.names import DEFAULT_MODEL
from kvctl.errors import SnapshotError
from kvctl.server.ingest.endpoint import check_endpoint
from kvctl.server.persistence import tree_image
from kvctl.server.state import Fleet
from kvctl.server.worker_info import WorkerInfo

SCHEMA = tree_image.SCHEMA
V2 = "kvctl.snapshot/v2"  # JSON lines, replayed event by event
SCHEMAS = ("kvctl.snapshot/v1", V2, SCHEMA)  # v1: no trailer, so no checksum
FILENAME = "snapshot.jsonl"
HEADER_BYTES = 64 << 20
"""The most a header line is read for, to tell an image from a dump: a worker table of ~500k workers."""
PREVIOUS = FILENAME + ".prev"
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Restored:
    taken_at: float
    events: int
    rejected: int
    path: Path  # the newest snapshot, or the previous one when the newest was damaged
    log_from: int = 0  # the first state-log segment it does not hold (`persistence.segments`)
    log_pos: int | None = None  # the state dir's changes it holds (`persistence.records.Mark`); None: not said


@dataclass(frozen=True, slots=True)
class Capture:
    """A fleet's state taken in one step on the event loop; encoding and writing it can happen anywhere."""

    header: dict[str, Any]
    models: list[tuple[str, list[DumpEdge]]]
    number: int = 0  # the order captures were taken in (`Writer`)


def capture(fleet: Fleet, taken_at: float, number: int = 0, log_from: int = 0,
            log_pos: int | None = None) -> Capture:
    header = {
        "schema": SCHEMA,
        "taken_at": taken_at,
        "log_from": log_from,
        "log_pos": log_pos,
        "models": {name: state.block_size for name, state in sorted(fleet.models.items())},
        "workers": [{"worker_id": i.worker_id, "dp_rank": i.dp_rank, "model": i.model, "endpoint": i.endpoint,
                     "replay_endpoint": i.replay_endpoint, "topic": i.topic} for i in fleet.workers.values()],
        "seqs": [{"worker_id": key[0], "dp_rank": key[1], "endpoint": endpoint, "seq": seq}
                 for (key, endpoint), seq in fleet.stream_seqs.items()
                 if key in fleet.workers and fleet.workers[key].endpoint == endpoint],  # no stale endpoint's
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


def _chunks(taken: Capture) -> Iterator[bytes]:
    """The file: header line, frames and trailer (`tree_image`)."""
    extra, frames = tree_image.encode(taken.models)
    digest, size = hashlib.sha256(), 0
    for chunk in itertools.chain([json.dumps(taken.header | extra).encode() + b"\n"], frames):
        digest.update(chunk)
        size += len(chunk)
        yield chunk
    yield json.dumps({"end": {"bytes": size, "sha256": digest.hexdigest()}}).encode() + b"\n"


def write(taken: Capture, state_dir: Path) -> Path:
    """`taken` as the newest snapshot (`install`). Touches nothing but `taken`, so it may run in a thread."""
    return install(_chunks(taken), state_dir)


def install(chunks: Iterable[bytes], state_dir: Path) -> Path:
    """Write `chunks` to a temporary file in the same directory and fsync it; then the current snapshot
    becomes the previous one and the new file takes its name, and the directory is fsynced.

    A crash before the first rename leaves both snapshots as they were; between the renames, only the
    previous one (which restore falls back to).
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / FILENAME
    tmp = state_dir / f".{FILENAME}.{os.getpid()}.tmp"
    for stale in state_dir.glob(f".{FILENAME}.*.tmp"):  # left by a process killed mid-write
        if stale != tmp:
            stale.unlink(missing_ok=True)
    try:
        with tmp.open("wb") as f:
            f.writelines(chunks)
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


class Progress(NamedTuple):
    """How far a restore in slices is: `done` of `total` `unit`s of its `phase` (shown by `/readyz`)."""

    phase: str
    done: int
    total: int
    unit: str


def run_to_end(steps: Generator[Any, None, T]) -> T:
    """A restore in slices (`restore_in_slices`, `replay.slices`) in one go: what a child process or a test
    that has no loop to yield to wants."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def restore(fleet: Fleet, state_dir: Path, now: float) -> tuple[Restored | None, list[str]]:
    """`restore_in_slices` in one go."""
    return run_to_end(restore_in_slices(fleet, state_dir, now))


def restore_in_slices(fleet: Fleet, state_dir: Path,
                      now: float) -> Generator[Progress, None, tuple[Restored | None, list[str]]]:
    """Load the newest sound snapshot into an empty fleet, yielding after each line read and each event
    applied (a router answers its probes in between). Returns it (None when there is none) and the problems
    found on the way: each damaged file is named and moved aside.

    A file is checked whole (trailer, checksum, then every line decoded and validated) before any of it
    is applied, so one bad line anywhere means the previous file or an empty start, never a mix."""
    problems: list[str] = []
    for path in (state_dir / FILENAME, state_dir / PREVIOUS):
        if not path.exists():
            continue
        try:
            contents = yield from _read_in_slices(path)
        except SnapshotError as exc:
            problems.append(f"{exc.message} ({_move_aside(path)})")
            continue
        restored = yield from _apply(fleet, contents, now)
        return restored, problems
    return None, problems


def _move_aside(path: Path) -> str:
    """Keep a damaged file for a post-mortem, out of the next start's way; a start never fails on it."""
    aside = path.with_name(f"{path.name}.damaged")
    try:
        os.replace(path, aside)
    except OSError as exc:
        return f"could not move it aside to {aside.name}: {exc.strerror or exc}"
    return f"moved to {aside.name}"


U32 = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
Name = Annotated[str, msgspec.Meta(min_length=1)]


class _Worker(msgspec.Struct):
    worker_id: Annotated[int, msgspec.Meta(ge=0)]  # and < 2**64: msgspec bounds stop at int64
    dp_rank: U32
    model: Name
    endpoint: str | None = None
    replay_endpoint: str | None = None
    topic: str = ""


class _Seq(msgspec.Struct):
    worker_id: Annotated[int, msgspec.Meta(ge=0)]  # and < 2**64, as a worker's
    dp_rank: U32
    endpoint: str
    seq: Annotated[int, msgspec.Meta(ge=0)]  # and < 2**64


class _Header(msgspec.Struct):
    """What a header must hold for the fleet to take it: the types `capture` writes, in their ranges."""

    schema: str
    taken_at: Annotated[float, msgspec.Meta(ge=0, lt=1e11)]  # epoch seconds: NaN and inf are refused
    models: dict[Name, Annotated[int, msgspec.Meta(ge=1, lt=2**32)]]
    workers: list[_Worker]
    log_from: Annotated[int, msgspec.Meta(ge=0)] = 0  # absent before the state log
    log_pos: Annotated[int, msgspec.Meta(ge=0)] | None = None  # absent before the log's marks
    seqs: list[_Seq] = []  # absent before streams resumed after a restart


class _Line(msgspec.Struct):
    model: Name
    event: dict[str, Any]


@dataclass(frozen=True, slots=True)
class _Contents:
    path: Path
    header: _Header
    events: list[tuple[str, RouterEvent]]  # v1 and v2: replayed one by one
    runs: dict[str, bulk.Runs] | None = None  # v3: each model's index, built in bulk


def image_events(path: Path, model: str | None) -> list[RouterEvent] | None:
    """The RouterEvents of `model` (None: the file's only model, else the default one) in a v3 image, checked
    as a restore checks it (SnapshotError): `kvctl tree` and `events publish` read a state dir's image as a dump;
    None for any other file (an older image is JSON lines, which the dump reader takes)."""
    try:
        with path.open("rb") as f:
            first = f.readline(HEADER_BYTES)
        if not first.startswith(b'{"schema"') or json.loads(first).get("schema") != SCHEMA:
            return None
    except (OSError, ValueError, RecursionError):  # unreadable, or not JSON (nested too deep, say)
        return None
    contents = _read(path)
    assert contents.runs is not None
    names = sorted(contents.runs)
    name = model if model is not None else names[0] if len(names) == 1 else DEFAULT_MODEL
    runs = contents.runs.get(name)
    if runs is None:
        raise SnapshotError(f"{path}: no model {name!r} in this image (it holds {', '.join(names) or 'none'})")
    return [RouterEvent(worker[0], stored, worker[1], n) for n, (worker, stored) in
            enumerate(bulk.events_of_runs(runs))]


def _read(path: Path) -> _Contents:
    """`_read_in_slices` in one go."""
    return run_to_end(_read_in_slices(path))


def _read_in_slices(path: Path) -> Generator[Progress, None, _Contents]:
    """The whole file, checked and decoded into typed records in one streaming pass, yielding after each
    line (v3: each slice of bytes or frame); SnapshotError naming the first problem, a damaged trailer or
    checksum before any line's own."""
    total = path.stat().st_size
    digest, lines, done, pending = hashlib.sha256(), 0, 0, None  # pending: the newest line, maybe the trailer
    events: list[tuple[str, RouterEvent]] = []
    first_problem: str | None = None
    try:
        with path.open("rb") as f:
            raw = _header_of(path, first := f.readline())
            if raw["schema"] == SCHEMA:
                return (yield from _read_runs(path, f, first, total, raw))
            digest.update(first)
            header, first_problem = _checked_header(path, raw)
            for line in f:
                if pending is not None:
                    digest.update(pending)
                    lines += 1
                    done += len(pending)
                    if first_problem is None and header is not None:
                        first_problem = _decode_line(path, lines + 1, pending, header, events)
                    yield Progress("reading the image", done, total, "bytes")
                pending = line
    except OSError as exc:
        raise SnapshotError(f"{path}: unreadable ({exc.strerror})") from None
    if raw["schema"] != V2:  # v1: no trailer, the last line is an event
        if pending is not None and first_problem is None and header is not None:
            first_problem = _decode_line(path, lines + 2, pending, header, events)
    else:
        try:
            end = json.loads(pending or b"")["end"]
            expected_lines, expected_sha = int(end["lines"]), str(end["sha256"])
        except (ValueError, KeyError, TypeError):
            raise SnapshotError(f"{path}: no trailer: the write was cut short") from None
        if lines + 1 != expected_lines or digest.hexdigest() != expected_sha:
            raise SnapshotError(f"{path}: checksum mismatch: the file changed after it was written")
    if first_problem is not None:
        raise SnapshotError(first_problem)
    assert header is not None  # a header that failed its check is the first problem
    return _Contents(path, header, events)


def _read_runs(path: Path, f: io.BufferedReader, first: bytes, total: int,
               raw: dict[str, Any]) -> Generator[Progress, None, _Contents]:
    """A v3 file (`tree_image`), from `f` past its header line `first`: read and checksummed, then decoded and
    checked frame by frame, yielding after each slice and frame; nothing of it applied yet."""
    data = bytearray(max(total, len(first)))
    at = len(first)
    with memoryview(data) as whole:
        whole[:at] = first
        while at < total and (got := f.readinto(whole[at:at + tree_image.SLICE_BYTES])):
            at += got
            yield Progress("reading the image", at, total, "bytes")
    del data[at:]  # a file that shrank as it was read: cut short, as the trailer tells
    view = memoryview(data)
    end = data.rfind(b"\n", 0, len(data) - 1) + 1
    try:
        trailer = json.loads(data[end:])["end"]
        size, sha = int(trailer["bytes"]), str(trailer["sha256"])
    except (ValueError, KeyError, TypeError):
        raise SnapshotError(f"{path}: no trailer: the write was cut short") from None
    digest = hashlib.sha256()
    for start in range(0, end, tree_image.SLICE_BYTES):
        digest.update(view[start:min(end, start + tree_image.SLICE_BYTES)])
        yield Progress("checking the image", start, end, "bytes")
    if size != end or digest.hexdigest() != sha:
        raise SnapshotError(f"{path}: checksum mismatch: the file changed after it was written")
    header, problem = _checked_header(path, raw)
    if problem is not None:
        raise SnapshotError(problem)
    assert header is not None
    frames = tree_image.body_in_slices(view[:end], len(first), raw, header.models)
    while True:
        try:
            done = next(frames)
        except StopIteration as finished:
            return _Contents(path, header, [], finished.value)
        except ValueError as exc:
            raise SnapshotError(f"{path}: {exc}") from None
        yield Progress("decoding the image", done, end, "bytes")


def _header_of(path: Path, first: bytes) -> dict[str, Any]:
    try:
        header = json.loads(first)
    except ValueError as exc:
        raise SnapshotError(f"{path}: unreadable header ({exc})") from None
    if not isinstance(header, dict) or header.get("schema") not in SCHEMAS:
        raise SnapshotError(f"{path}: not a kvctl snapshot ({', '.join(SCHEMAS)})")
    return header


def _checked_header(path: Path, raw: dict[str, Any]) -> tuple[_Header | None, str | None]:
    """The header as the fleet takes it, or what is wrong with it (told once the checksum is known good)."""
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
        for s in header.seqs:
            if s.worker_id >= 2**64 or s.seq >= 2**64:
                raise ValueError(f"stream seq {s.seq} of worker {s.worker_id}: not a u64")
    except (msgspec.ValidationError, ValueError) as exc:
        return None, f"{path}:1: bad header: {exc}"
    return header, None


def _decode_line(path: Path, n: int, line: bytes, header: _Header,
                 events: list[tuple[str, RouterEvent]]) -> str | None:
    """Line `n` appended to `events`; or what is wrong with it."""
    try:
        item = _fast_line(line)
        if item is None:  # not what `capture` writes, or out of range: the general decoder says which
            generic = msgspec.json.decode(line, type=_Line)
            item = (generic.model, decode_router_event_json(generic.event))
        if item[0] not in header.models:
            raise ValueError(f"model {item[0]!r} is not among the header's models")
    except (msgspec.DecodeError, ValueError, DecodeError) as exc:
        return f"{path}:{n}: {exc}"
    events.append(item)
    return None


class _FastBlock(msgspec.Struct, gc=False):  # gc=False: a million of them must not set off collections
    block_hash: int
    tokens_hash: int


class _FastStored(msgspec.Struct, gc=False):
    blocks: list[_FastBlock]
    parent_hash: int | None = None


class _FastData(msgspec.Struct, forbid_unknown_fields=True, gc=False):  # one variant (serde's externally tagged enum)
    stored: _FastStored


class _FastEvent(msgspec.Struct, gc=False):
    event_id: Annotated[int, msgspec.Meta(ge=0)]
    data: _FastData
    dp_rank: U32 = 0


class _FastRouterEvent(msgspec.Struct, gc=False):
    worker_id: Annotated[int, msgspec.Meta(ge=0)]
    event: _FastEvent
    storage_tier: Tier = Tier.device


class _FastLine(msgspec.Struct, gc=False):
    model: Name
    event: _FastRouterEvent


_decode_fast = msgspec.json.Decoder(_FastLine).decode


def _fast_line(line: bytes) -> tuple[str, RouterEvent] | None:
    """A line as `capture` writes it (one Stored event), decoded by typed msgspec in C: four times faster
    than the general RouterEvent decoder, which walks every block in Python. None for anything else (another
    variant, a value out of its range), which the general decoder then reads, or refuses naming the field:
    both accept and build the same events."""
    try:
        item = _decode_fast(line)
        ev = item.event
        stored = ev.event.data.stored
        blocks = stored.blocks
        block_hashes = [b.block_hash for b in blocks]
        array("Q", block_hashes)  # u64 each, or OverflowError
        tokens_hashes = array("Q", [b.tokens_hash for b in blocks])
    except (msgspec.ValidationError, OverflowError):
        return None
    parent = stored.parent_hash
    if ev.worker_id >= 2**64 or ev.event.event_id >= 2**64 or (parent is not None and not 0 <= parent < 2**64):
        return None
    return item.model, RouterEvent(ev.worker_id, Stored(parent, block_hashes, tokens_hashes, ev.storage_tier),
                                   ev.event.dp_rank, ev.event.event_id)


def _apply(fleet: Fleet, contents: _Contents, now: float) -> Generator[Progress, None, Restored]:
    """Every record of a file `_read_in_slices` accepted, yielding after each event: nothing here can fail
    half way."""
    header = contents.header
    for name, block_size in header.models.items():
        fleet.add_model(name, block_size=block_size)
    for w in header.workers:
        fleet.register(WorkerInfo(w.worker_id, w.dp_rank, w.model, w.endpoint, w.replay_endpoint, w.topic))
    for s in header.seqs:
        fleet.applied_seq(((s.worker_id, s.dp_rank), s.endpoint), s.seq)
    if contents.runs is not None:
        events, rejected = yield from _build(fleet, contents.runs, now)
        return Restored(header.taken_at, events, rejected, contents.path, header.log_from, header.log_pos)
    events = rejected = 0
    total = len(contents.events)
    for n, (model, event) in enumerate(contents.events, 1):
        applied, bad = fleet.apply(model, (event,), now)
        events += applied
        rejected += sum(bad.values())
        yield Progress("applying the image", n, total, "events")
    return Restored(header.taken_at, events, rejected, contents.path, header.log_from, header.log_pos)


def _build(fleet: Fleet, models: dict[str, bulk.Runs], now: float) -> Generator[Progress, None, tuple[int, int]]:
    """Each model's index built from its runs, yielding after each run; where the builder cannot build what a
    replay would (`bulk.Builder`), the runs' events replayed one by one instead. Returns (applied, rejected)."""
    events = rejected = done = 0
    total = sum(len(runs.runs) for runs in models.values())
    for name, runs in models.items():
        builder = bulk.Builder(fleet.add_model(name).router.index, runs)
        built = True
        for run in runs.runs:
            built = built and builder.add(run)
            done += 1
            yield Progress("building the index", done, total, "runs")
        if built and builder.finish():
            stored = bulk.pairs_of(runs.runs)
            fleet.built(name, runs.workers, stored, now)
            events += stored
            continue
        builder.reset()
        replaying = bulk.pairs_of(runs.runs)
        for replayed, (worker, event) in enumerate(bulk.events_of_runs(runs), 1):
            applied, bad = fleet.apply(name, (RouterEvent(worker[0], event, worker[1], 0),), now)
            events += applied
            rejected += sum(bad.values())
            yield Progress("replaying the image", replayed, replaying, "events")
    return events, rejected


def delete(state_dir: Path) -> bool:
    """Delete both snapshots and the state log after them; True when there was one."""
    found = False
    for path in (state_dir / FILENAME, state_dir / PREVIOUS, *state_dir.glob("state.log.*")):
        if path.exists():
            path.unlink()
            found = True
    return found
