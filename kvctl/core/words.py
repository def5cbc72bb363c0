"""A count and its noun agreeing in number (`1 block`, `2 blocks`): the same in a finding, a log line and a
command's output, never `1 blocks` or `worker(s)`."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and `noun`, the noun plural unless `n` is 1; `plural` for nouns not made plural with an s."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
