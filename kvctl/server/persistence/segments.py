"""Where the state log's segments live in a state dir: `state.log.N`, N counting up.

An image records the first segment it does not hold (`log_from`), so a restore replays the segments from
there on, and a compaction may delete those before the *previous* image's `log_from`: both images stay
restorable, as `snapshot.py` promises.
"""

from __future__ import annotations

from pathlib import Path

PREFIX = "state.log."


def name(number: int) -> str:
    return f"{PREFIX}{number:08d}"


def path(state_dir: Path, number: int) -> Path:
    return state_dir / name(number)


def numbers(state_dir: Path) -> list[int]:
    """The segments present, oldest first (set-aside `.damaged` ones are not)."""
    found = []
    for file in state_dir.glob(PREFIX + "*"):
        tail = file.name[len(PREFIX):]
        if tail.isdigit():
            found.append(int(tail))
    return sorted(found)


def delete_before(state_dir: Path, number: int) -> int:
    """Delete the segments older than `number`; returns how many went."""
    gone = 0
    for n in numbers(state_dir):
        if n < number:
            path(state_dir, n).unlink(missing_ok=True)
            gone += 1
    return gone


def size_from(state_dir: Path, number: int) -> int:
    """Bytes in the segments from `number` on: the log a restore would replay."""
    return sum(path(state_dir, n).stat().st_size for n in numbers(state_dir) if n >= number)
