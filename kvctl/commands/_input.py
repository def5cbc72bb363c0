"""Where a command's numbers come from: its arguments, a file, or stdin (in that order of preference).

`kvctl route` reads token ids (parsed as `kvctl hash` parses them) or, with --local-hashes, u64 block
hashes; both accept whitespace-, comma- or JSON-list-separated text, so a pasted `[1, 2, 3]` works.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

from kvctl.errors import UsageError

Parser = Callable[[str, str], list[int]]
"""(text, where it came from, for messages) -> the numbers in it."""


def read_numbers(args: list[str] | None, file: Path | None, parse: Parser, what: str) -> list[int]:
    """The numbers given as arguments, in --file, or on stdin (when it is not a terminal); `what` names them."""
    if args and file is not None:
        raise UsageError(f"give {what} as arguments or with --file, not both")
    if args:
        return parse(" ".join(args), "the arguments")
    if file is not None:
        try:
            return parse(file.read_text(), str(file))
        except OSError as exc:
            raise UsageError(f"cannot read {file}: {exc.strerror}") from None
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError(f"no {what} given", hint="pass them as arguments, with --file, or on stdin")
    return parse(sys.stdin.read(), "stdin")


def parse_hash_text(text: str, source: str) -> list[int]:
    """u64 block hashes as a tree dump or `kvctl hash` prints them in any `--hash-format` (decimal, "quoted",
    0x hex), separated like token ids."""
    hashes = []
    for word in re.split(r"[\s,\[\]]+", text.strip()):
        word = word.strip('"')
        if not word:
            continue
        try:
            value = int(word, 16) if word.lower().startswith("0x") else int(word, 10)
        except ValueError:
            raise UsageError(f"hash {word!r} from {source} is not an integer") from None
        if not 0 <= value < 2**64:
            raise UsageError(f"hash {value} from {source} is outside [0, 2^64)", hint="block hashes are u64")
        hashes.append(value)
    return hashes
