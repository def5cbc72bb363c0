"""Secrets given on the command line, blanked where `ps` reads them.

`/proc/PID/cmdline` (what `ps` and `top` show any local user) is read from the process's own argv
memory, which Python copies at start and never writes again. kvctl overwrites the values of its
secret options there, in place, as soon as it starts: a router that runs for weeks shows
`--admin-token ****` rather than its token. The value was visible for the moment before, and stays in
shell history: the KVCTL_* variables (KVCTL_ADMIN_TOKEN, KVCTL_NATS_TOKEN, ...) are the way that
never shows it at all. Linux only; elsewhere nothing is blanked.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Sequence
from pathlib import Path

SECRET_OPTIONS = ("--admin-token", "--token", "--nats-token", "--nats-password")
"""Options whose value is a secret. URLs with credentials (nats://user:pass@host) are blanked too."""

_URL_CREDENTIALS = re.compile(rb"(?<=://)[^/@\s]+(?=@)")


def secret_spans(args: Sequence[bytes]) -> list[tuple[int, int]]:
    """(argument index, offset in it) of every secret option's value in `args`: what to blank from the
    offset on, for `--admin-token VALUE` and `--admin-token=VALUE` alike."""
    spans = []
    for n, arg in enumerate(args):
        name, eq, _ = arg.partition(b"=")
        if eq and name.decode(errors="replace") in SECRET_OPTIONS:
            spans.append((n, len(name) + 1))
        elif n and args[n - 1].decode(errors="replace") in SECRET_OPTIONS:
            spans.append((n, 0))
    return spans


def _blanked(arg: bytes, offset: int) -> bytes:
    return arg[:offset] + b"*" * (len(arg) - offset)


def blank(args: Sequence[bytes]) -> list[bytes]:
    """`args` with every secret value replaced by as many '*' (the same length: written back in place)."""
    out = list(args)
    for n, offset in secret_spans(args):
        out[n] = _blanked(out[n], offset)
    return [_URL_CREDENTIALS.sub(lambda m: b"*" * len(m.group()), arg) for arg in out]


def scrub_process_argv(stat: Path = Path("/proc/self/stat")) -> bool:
    """Blank the secrets in this process's argv memory (what /proc/self/cmdline shows); True if any were.

    arg_start and arg_end are fields 48 and 49 of /proc/self/stat (Linux 3.5+): the one range the
    kernel reads cmdline from, which is this process's own writable stack memory."""
    try:
        fields = stat.read_text().rpartition(")")[2].split()
        start, end = int(fields[45]), int(fields[46])  # fields 48, 49: the list starts at field 3
    except (OSError, IndexError, ValueError):
        return False
    if not 0 < start < end:
        return False
    memory = ctypes.string_at(start, end - start)
    args = memory.split(b"\0")
    scrubbed = b"\0".join(blank(args))
    if scrubbed == memory:
        return False
    ctypes.memmove(start, scrubbed, len(scrubbed))
    return True
