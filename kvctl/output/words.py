"""The words a person reads for a router's numbers, the same in a command's table and in `kvctl top`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def age(seconds: float | None) -> str | None:
    """An age as a person reads it at a glance (`45s`, `12m3s`, `2h5m`); None (shown `-`) for never."""
    if seconds is None:
        return None
    if seconds < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{seconds:.0f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes}m"


def stream_state(stream: Mapping[str, Any]) -> str:
    """One word for an engine stream: replaying a gap, gapped (lost events since it started), waiting (no
    message yet) or ok."""
    if stream.get("replaying"):
        return "replaying"
    if stream.get("gapped"):
        return "gapped"
    return "ok" if stream.get("messages") else "waiting"
