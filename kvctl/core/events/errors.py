"""The one exception every event decoder raises, and the few helpers all decoders raise it through.

A router fed by dozens of engines must survive any byte sequence, and an operator debugging a
silent engine needs to know *why* its events were dropped (wrong hash type? placeholder block
size?). So decoders never leak KeyError/TypeError: each problem becomes a `DecodeError` whose
`kind` is a stable label (used as a metric label) and whose message names the offending field.
The untyped msgpack/JSON parse lives here too, so every codec turns malformed input (including
nesting deep enough to raise RecursionError) into the same error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")


class ErrorKind(StrEnum):
    """Why something failed to decode; the values are stable metric labels."""

    bad_msgpack = "bad_msgpack"  # not valid msgpack (or nested too deep)
    bad_json = "bad_json"  # not valid JSON (or nested too deep)
    bad_batch = "bad_batch"  # a frame or batch envelope of the wrong shape
    unknown_type = "unknown_type"  # an event tag / variant kvctl does not know
    missing_field = "missing_field"  # a required field is absent
    bad_type = "bad_type"  # a field of the wrong type or out of its range
    bad_hash = "bad_hash"  # a block hash that is not a 64-bit int (or bytes, from engines)
    bad_tokens = "bad_tokens"  # token ids not u32 ints, or too few for the event's blocks
    bad_block_size = "bad_block_size"  # a block size that is not a positive u32 int
    bad_tier = "bad_tier"  # a medium / storage tier kvctl cannot map to a Tier


class DecodeError(Exception):
    """A decode failure: `kind` classifies it, `field` names where, `index` is the event's batch position.

    `index` is None for failures that are not about one event of a batch (a bad frame, a bad
    batch envelope, a single RouterEvent).
    """

    def __init__(self, kind: ErrorKind, field: str, detail: str, index: int | None = None) -> None:
        super().__init__(kind, field, detail, index)
        self.kind = kind
        self.field = field
        self.detail = detail
        self.index = index

    def __str__(self) -> str:
        where = f"event {self.index}: " if self.index is not None else ""
        return f"{where}{self.kind.value}: {self.field}: {self.detail}"


_MISSING = object()


def require(fields: Mapping[Any, Any], key: str, field: str | None = None) -> Any:
    """`fields[key]`, or a missing_field DecodeError naming `field` (default: the key)."""
    value = fields.get(key, _MISSING)
    if value is _MISSING:
        raise DecodeError(ErrorKind.missing_field, field or key, "required field is absent")
    return value


def as_map(value: Any, field: str) -> dict[Any, Any]:
    """`value` if it is a map, else a bad_type DecodeError naming `field`."""
    if not isinstance(value, dict):
        raise DecodeError(ErrorKind.bad_type, field, f"expected a map, got {describe(value)}")
    return value


def as_uint(value: Any, field: str, maximum: int = (1 << 64) - 1) -> int:
    """`value` if it is an int in [0, maximum] (a u64 by default), else a bad_type DecodeError naming `field`."""
    if type(value) is not int or not 0 <= value <= maximum:
        raise DecodeError(ErrorKind.bad_type, field, f"expected an unsigned int, got {describe(value)}")
    return value


def as_text(value: Any, field: str) -> str:
    """`value` if it is a non-empty string, else a bad_type DecodeError naming `field`."""
    if not isinstance(value, str) or not value:
        raise DecodeError(ErrorKind.bad_type, field, f"expected a non-empty string, got {describe(value)}")
    return value


def as_u64(value: Any, field: str) -> int:
    """`value` if it is an integer in u64 range, else a bad_type DecodeError naming `field`."""
    if type(value) is not int or not 0 <= value < 1 << 64:
        raise DecodeError(ErrorKind.bad_type, field, f"expected a u64, got {describe(value)}")
    return value


def decode_each(items: list[Any], decode: Callable[[Any], T]) -> tuple[list[T], list[DecodeError]]:
    """Decode every item of a batch: a bad one costs itself, not the batch, and comes back as a DecodeError
    carrying its index."""
    decoded: list[T] = []
    errors: list[DecodeError] = []
    for n, item in enumerate(items):
        try:
            decoded.append(decode(item))
        except DecodeError as exc:
            errors.append(DecodeError(exc.kind, exc.field, exc.detail, n))
    return decoded, errors


def describe(value: object) -> str:
    """A short rendering of a decoded value for messages: containers by size only, never a deep repr.

    A repr of hostile input could be huge or nest deep enough to raise RecursionError itself.
    """
    if isinstance(value, list | tuple):
        return f"an array of {len(value)}"
    if isinstance(value, dict):
        return f"a map of {len(value)}"
    if value is None:
        return "null"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_msgpack(data: bytes | msgspec.Raw) -> Any:
    """Untyped msgpack decode; malformed (bad UTF-8 too) or too deep input is a bad_msgpack DecodeError."""
    try:
        return msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise DecodeError(ErrorKind.bad_msgpack, "payload", str(exc)) from None


def parse_json(data: bytes | str) -> Any:
    """Untyped JSON decode (integers stay exact Python ints); bad input is a bad_json DecodeError."""
    try:
        return msgspec.json.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise DecodeError(ErrorKind.bad_json, "payload", str(exc)) from None
