"""kvctl's internal KV event model (docs/contract.md), shared by every codec and by the index.

Hashes are unsigned 64-bit ints. A `Stored` keeps its blocks as two parallel lists (engine block
hashes and local token hashes) because the index slices them into compressed edges; building one
object per block would cost more than the index itself. Codecs build lists; the router's decode process
hands over local hashes and removed hashes as `array('Q')`, so the index gets them without an int per
block (see `kvctl.server.ingest.decode_process.wire`). Anything that reads them takes either.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

import msgspec

from kvctl.core.names import WorkerKey


class Tier(StrEnum):
    """Where a block lives; the values are Dynamo's `storage_tier` strings."""

    device = "device"
    host_pinned = "host_pinned"
    disk = "disk"
    external = "external"


TIER_VALUES: dict[Tier, str] = {t: t.value for t in Tier}
"""Each tier's value, by dict lookup: an enum's `.value` is a Python-level property, slow once per event."""


class Group(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """The KV cache group an engine event names (vLLM's hybrid models publish every group on one stream): what
    Dynamo keeps or drops an event by (`kvctl.core.events.normalizer`). Fields are as the engine sent them."""

    idx: int | None
    kind: str | None = None
    window: int | None = None
    block_size: int | None = None


class Rehash(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """What an unsalted store's blocks were hashed from: its stream's normalizer hashes them again under the salt
    of a salted parent, which Dynamo's store inherits (`tokens`: little-endian u32s, the store's blocks only)."""

    tokens: bytes
    block_size: int
    lora_name: str | None
    eagle: bool


class Stored(msgspec.Struct, frozen=True, gc=False):
    """A store. `group` and `salt` (the cache salt its local hashes were made with) are for the stream's
    normalizer; `cut` names why the engine's last `cut_blocks` blocks could not be hashed (Dynamo drops them);
    `rehash`, kept for an unsalted store with a parent when the decoder was asked to, lets it inherit a salt. Its
    hashes may be an `array('Q')` (the router's decode process hands them over packed, as the index keeps them)."""

    parent_hash: int | None
    block_hashes: Sequence[int]
    tokens_hashes: Sequence[int]
    tier: Tier = Tier.device
    group: Group | None = None
    salt: str | None = None
    cut: str | None = None
    cut_blocks: int = 0
    rehash: Rehash | None = None


class Removed(msgspec.Struct, frozen=True, gc=False):
    block_hashes: Sequence[int]
    tier: Tier = Tier.device
    group: Group | None = None


class Cleared(msgspec.Struct, frozen=True, gc=False):
    """Every block of one (worker, dp_rank), on every tier."""


EventData = Stored | Removed | Cleared


class RouterEvent(msgspec.Struct, frozen=True, gc=False):
    """One event of one worker key `(worker_id, dp_rank)`: what the index applies."""

    worker_id: int
    data: EventData
    dp_rank: int = 0
    event_id: int = 0

    @property
    def worker(self) -> WorkerKey:
        return (self.worker_id, self.dp_rank)
