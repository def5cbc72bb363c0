"""A file named as a source of RouterEvents (`kvctl tree`, `events publish`): a dump in any shape the dump
reader takes, or a kvctl state dir's image, whose body is binary since v3."""

from __future__ import annotations

import sys
from pathlib import Path

from kvctl.core.events import RouterEvent
from kvctl.errors import UsageError
from kvctl.output import Output


def file_events(source: str, model: str | None, out: Output) -> list[RouterEvent]:
    """The events of `source` (`-`: stdin). An image holds each model's index: `model` picks one (by default
    its only one, else the default model); a dump holds one model's events, and `model` does not apply."""
    from kvctl.core.events.dump_file import DumpFileError, read_router_events

    if source != "-":
        from kvctl.server.snapshot import image_events

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
        raise UsageError(f"{source}: not UTF-8 text (byte {exc.start}): not a dump file") from None
    try:
        return read_router_events(text)
    except DumpFileError as exc:
        raise UsageError(f"{source}: {exc}") from None
