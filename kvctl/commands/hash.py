"""`kvctl hash`: the block hashes a Dynamo router computes for some token ids.

The first thing to check when overlap is always zero: hash the prompt here and compare with what
the engine's events or the router's tree dump carry (block size and LoRA name included).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kvctl.commands._hashes import HashFormat, HashFormatOpt, shown_hashes
from kvctl.commands._input import read_numbers
from kvctl.commands._options import JsonOpt, OutputOpt, output_for
from kvctl.core.hashing import packed_block_hashes, sequence_hashes
from kvctl.core.words import counted
from kvctl.errors import UsageError
from kvctl.output import Column, View

HELP = "Compute Dynamo's local and sequence block hashes for token ids. (read-only)"
EXAMPLES = (
    "Examples:\n\n"
    "  kvctl hash 1 2 3 4 --block-size 4\n\n"
    "  kvctl hash --file token-ids.json -o json    # token ids: [1, 2, 3, 4], or one a line\n\n"
    "  kvctl hash 1 2 3 4 -b 4 -o json --hash-format str | jq -r '.local_hashes[]'    # any jq\n\n"
    "  echo '[1, 2, 3, 4]' | kvctl hash --block-size 4 --lora-name sql-lora"
)

_VIEW = View(
    rows=lambda data: [
        {"block": i, "local_hash": local, "sequence_hash": seq}
        for i, (local, seq) in enumerate(zip(data["local_hashes"], data["sequence_hashes"], strict=True))
    ],
    columns=[Column("block", "block", justify="right"), Column("local hash", "local_hash"),
             Column("sequence hash", "sequence_hash")],
    name_key="sequence_hash",
)


def parse_token_text(text: str, source: str) -> list[int]:
    """Token ids from text: whitespace, comma or JSON-list separated, so a pasted `[1, 2, 3]` works."""
    words = text.replace(",", " ").replace("[", " ").replace("]", " ").split()
    return [_token(word, source) for word in words]


def _token(word: str, source: str) -> int:
    try:
        value = int(word, 10)
    except ValueError:
        raise UsageError(f"token {word!r} from {source} is not an integer",
                         hint="token ids are non-negative integers, not text: tokenize the prompt first") from None
    if not 0 <= value < 2**32:
        raise UsageError(f"token {value} from {source} is outside [0, 2^32)",
                         hint="Dynamo hashes token ids as u32") from None
    return value


def hash_command(
    ctx: typer.Context,
    tokens: Annotated[list[str] | None, typer.Argument(help="Token ids (or use --file, or stdin).",
                                                       show_default=False)] = None,
    file: Annotated[Path | None, typer.Option(
        "--file", "-f", dir_okay=False, help="Read token ids from this file: integers, as a JSON list or separated "
                                             "by spaces, commas or newlines (not text: tokenize first).")] = None,
    block_size: Annotated[int, typer.Option("--block-size", "-b", help="Tokens per KV block.")] = 16,
    lora_name: Annotated[str | None, typer.Option("--lora-name", help="LoRA adapter name (changes the seed).")]
    = None,
    cache_salt: Annotated[str | None, typer.Option("--cache-salt", help="Cache salt (SGLang's cache_salt; changes "
                                                   "the seed).", show_default=False)] = None,
    eagle: Annotated[bool, typer.Option("--eagle", help="Hash as an EAGLE worker stores blocks: B + 1 tokens each, "
                                        "overlapping by one.")] = False,
    hash_format: HashFormatOpt = HashFormat.dec,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
) -> None:
    out = output_for(ctx, output, as_json)
    if block_size <= 0:
        raise UsageError(f"--block-size must be positive, got {block_size}", hint="e.g. --block-size 16")
    ids = read_numbers(tokens, file, parse_token_text, "token ids")
    local = packed_block_hashes(ids, block_size, lora_name=lora_name, cache_salt=cache_salt, eagle=eagle).tolist()
    data: dict[str, Any] = {"block_size": block_size, "local_hashes": local, "sequence_hashes": sequence_hashes(local)}
    data.update({k: v for k, v in (("lora_name", lora_name), ("cache_salt", cache_salt), ("eagle", eagle)) if v})
    tail = (len(ids) - 1) % block_size if eagle and ids else len(ids) % block_size
    if tail:
        out.warn(f"the last {counted(tail, 'token')} fill no block of {block_size}: not hashed")
    out.emit(shown_hashes(data, hash_format), _VIEW)
