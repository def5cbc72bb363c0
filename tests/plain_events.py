"""Events as plain tuples, hashes as lists: what tests compare of events that may have crossed the decode
process, which hands some hashes over packed (`array('Q')`), where a codec gives lists."""

from __future__ import annotations

from kvctl.core.events import EventData, Removed, Stored


def plain(event: EventData) -> tuple[object, ...]:
    if isinstance(event, Stored):
        return ("stored", event.parent_hash, list(event.block_hashes), list(event.tokens_hashes), event.tier)
    if isinstance(event, Removed):
        return ("removed", list(event.block_hashes), event.tier)
    return ("cleared",)
