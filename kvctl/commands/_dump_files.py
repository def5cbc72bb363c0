"""A file named as a source of RouterEvents (`kvctl tree`, `events publish`): a dump in any shape the dump
reader takes, a kvctl state dir's image, whose body is binary since v3, or a whole state dir (its image and the
state log after it), read offline as a restart would restore it."""

from __future__ import annotations

import sys
from pathlib import Path

from kvctl.core.events import RouterEvent
from kvctl.errors import KvctlError, UsageError
from kvctl.output import Output


def file_events(source: str, model: str | None, out: Output) -> list[RouterEvent]:
    """The events of `source` (`-`: stdin). An image holds each model's index: `model` picks one (by default
    its only one, else the default model); a dump holds one model's events, and `model` does not apply."""
    from kvctl.core.events.dump_file import DumpFileError, read_router_events

    if source != "-" and Path(source).is_dir():
        return state_dir_events(Path(source), model, out)
    if source != "-":
        from kvctl.server.persistence.snapshot import image_events

        events = image_events(Path(source), model)
        if events is not None:
            return events
    if model is not None:
        out.warn(f"--model picks a router's (or an image's) model; the dump file {source} holds one model's "
                 "events and is read whole")
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text()
    except OSError as exc:
        raise UsageError(f"cannot read {source}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise KvctlError(f"{source}: binary, not a dump file (not UTF-8 at byte {exc.start})",
                         hint=_binary_hint(Path(source))) from None
    try:
        return read_router_events(text)
    except DumpFileError as exc:
        raise UsageError(f"{source}: {exc}") from None


def state_dir_events(path: Path, model: str | None, out: Output) -> list[RouterEvent]:
    """`model`'s index (None: the state dir's only model with workers, else `default`) as a restart would restore
    it: the newest good image, then the state log after it. What the restore could not read is said on stderr, so
    an offline answer is never taken for the whole index when it is not."""
    import time

    from kvctl.core.names import implied_model
    from kvctl.core.words import counted
    from kvctl.server.persistence import replay, segments
    from kvctl.server.persistence.snapshot import FILENAME, PREVIOUS, SnapshotError
    from kvctl.server.state import Fleet

    if not segments.numbers(path) and not (path / FILENAME).exists() and not (path / PREVIOUS).exists():
        raise UsageError(f"{path} is a directory, not a kvctl state dir (no image, no state.log.* segment)")
    fleet = Fleet()
    try:
        done = replay.restore(fleet, path, time.monotonic())
    except (OSError, SnapshotError) as exc:
        raise KvctlError(f"cannot read the state dir {path}: {exc}") from None
    for problem in done.problems:
        out.warn(f"{path}: {problem}")
    if done.stopped is not None:
        out.warn(f"{path}: the state log is damaged at {done.stopped}: what follows it is not in this answer")
    if done.dropped:
        out.warn(f"{path}: the state log says {counted(done.dropped, 'change was', 'changes were')} dropped (its "
                 "writer behind the disk)")
    by_model: dict[str, int] = {}
    for info in fleet.workers.values():
        by_model[info.model] = by_model.get(info.model, 0) + 1
    name = model or implied_model(by_model)[0]
    return fleet.model(name).router.index.dump()


def _binary_hint(path: Path) -> str:
    if path.name.startswith("state.log."):
        return f"it is a kvctl state log segment: give its state dir ({path.parent}) to read the image and the log"
    return "a dump is JSON, JSONL or recorder lines; a kvctl state dir (or its image) is read as a directory"
