"""How block hashes are written in an answer (`--hash-format`): u64s as JSON numbers are exact, but jq before 1.7,
JavaScript and every tool that reads numbers as doubles round them past 2^53, so a pipeline through them hashes
nothing; strings survive every tool. One default base (decimal) across `hash`, `tree` and `events tail`."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

import typer

HASH_KEYS = frozenset({"local_hashes", "sequence_hashes", "block_hashes", "parent_hash", "local_hash",
                       "sequence_hash", "block_hash", "tokens_hash", "token_sequence"})
"""The fields that hold block hashes in any answer kvctl prints (hash, RouterEvents, dump rows, decisions)."""


class HashFormat(StrEnum):
    dec = "dec"  # JSON numbers: exact, as Dynamo writes them
    str = "str"  # decimal strings: for jq < 1.7, JavaScript, spreadsheets
    hex = "hex"  # 0x-prefixed strings, as some engine logs print them


HashFormatOpt = Annotated[HashFormat, typer.Option(
    "--hash-format", help="Block hashes as dec (JSON numbers), str (decimal strings: safe for jq < 1.7 and "
                          "JavaScript) or hex (0x strings). `kvctl route --local-hashes` reads all three.")]


def shown_hashes(data: Any, fmt: HashFormat) -> Any:
    """`data` with every hash field (`HASH_KEYS`, at any depth) written in `fmt`; the same object for `dec`."""
    if fmt is HashFormat.dec:
        return data
    if isinstance(data, dict):
        return {k: _written(v, fmt) if k in HASH_KEYS else shown_hashes(v, fmt) for k, v in data.items()}
    if isinstance(data, list):
        return [shown_hashes(v, fmt) for v in data]
    return data


def hash_text(value: int, fmt: HashFormat) -> str:
    """One hash in a line of text: 0x-prefixed for `hex`, decimal otherwise."""
    return f"{value:#x}" if fmt is HashFormat.hex else str(value)


def _written(value: Any, fmt: HashFormat) -> Any:
    if isinstance(value, list):
        return [_written(v, fmt) for v in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return hash_text(value, fmt)
    return value
