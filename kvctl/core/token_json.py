"""Token ids straight from a request's JSON, without a Python int per token.

`POST /v1/route` carries a prompt of thousands of token ids. msgspec decoding them into a list of ints,
checking each against the u32 range and `array` packing them again cost half of a route's server time; the C
reader (`_native.c`, via `native`) writes the u32s as it reads the digits, and the hashing reads that buffer as
it is.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

from kvctl.core import native

if TYPE_CHECKING:  # collections.abc.Buffer from Python 3.12 on
    from typing_extensions import Buffer


def token_ids_from_json(raw: Buffer) -> array[int]:
    """The JSON array in `raw` as u32 token ids; ValueError, worded like msgspec's, for anything else."""
    ids = array("I")
    ids.frombytes(native.u32_from_json(raw))
    return ids


def token_ids_at_head(raw: bytes) -> tuple[array[int], bytes] | None:
    """For a JSON object that opens with a sound `"token_ids"` array, as clients write a route request: those
    ids, and the object's other members as an object of their own, to decode without reading the array twice.
    None for any other body, to be read whole (which also words any error)."""
    head = native.u32_head_of_object(raw)
    if head is None:
        return None
    packed, rest = head
    ids = array("I")
    ids.frombytes(packed)
    return ids, b"{" + raw[rest:]
