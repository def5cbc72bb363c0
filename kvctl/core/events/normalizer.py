"""What Dynamo 1.6.1 keeps of one engine stream, for the rules that need the stream's history (docs/contract.md,
"Which engine events are indexed"): its ZMQ normalizer, per listener, as observed on its standalone indexer.

- **Groups.** A hybrid model (GPT-OSS, Qwen3-Next, Nemotron-H) publishes every KV cache group on one stream, the
  same block hashes in each. Dynamo indexes the full-attention groups only. A store that names both its
  `group_idx` and its kind teaches the stream that group's kind (per DP rank); an event's own kind decides it,
  else its group's learned kind, else only group 0 is kept. Without that, a sliding window's removes would
  empty the index while the full-attention group still holds every block.
- **Salts.** An unsalted store under a salted parent inherits the salt, as in Dynamo: vLLM names a request's salt
  in its first block only, so a salted request's later stores come unsalted. Its blocks are hashed again under
  the salt, from the token ids the decoder kept (`Stored.rehash`); one that came without them (the decode
  process sends them once its stream has stored salted blocks) is dropped under its own cause, counted, never
  indexed wrongly. Under a block stored both salted and unsalted, a store is dropped, as in Dynamo.
- **Cuts.** What the decoder cut from a store (`Stored.cut`) is counted here, after the group filter, where
  Dynamo's conversion comes in its order.

Disk and external tiers skip the groups and salts, as in Dynamo. Every drop is counted by its cause
(`Dropped`); each group's kind, window, block size and kept/dropped events are kept for `kvctl workers`.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import msgspec
from xxhash import xxh3_64_intdigest

from kvctl.core.events.engine_fields import Dropped
from kvctl.core.events.types import Cleared, EventData, Group, Rehash, Removed, Stored, Tier
from kvctl.core.hashing import block_hashes_of_packed, block_seed, eagle_block_hashes

__all__ = ["GroupSeen", "StreamNormalizer"]

MAIN_KINDS: Final = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
OTHER_KINDS: Final = frozenset({"sliding_window", "sliding_window_mla", "mamba", "chunked_local_attention",
                                "encoder_only_attention", "cross_attention"})
"""vLLM's `KVCacheSpecKind`s as Dynamo 1.6.1 sorts them; any other string is a kind Dynamo does not know."""

MAX_GROUPS = 256
"""Groups one stream's stats and learning hold: a model has a handful; a stream naming more is not a model."""
MAX_SALTED_BLOCKS = 1 << 20
"""Salted blocks one stream remembers (an engine's cache holds fewer); past it a salted parent is not known."""
MAX_SALTS = 4096
"""Distinct salts counted per stream; past it the count says "at least"."""

_AMBIGUOUS: Final = object()
_LOWER = (Tier.disk, Tier.external)


@dataclass(slots=True)
class GroupSeen:
    """One KV cache group of one DP rank as the stream showed it: what `kvctl workers` lists."""

    dp_rank: int
    idx: int
    kind: str | None = None
    window: int | None = None
    block_size: int | None = None
    kept: int = 0
    dropped: int = 0

    def row(self) -> dict[str, object]:
        return {"dp_rank": self.dp_rank, "group_idx": self.idx, "kind": self.kind, "sliding_window": self.window,
                "block_size": self.block_size, "events_kept": self.kept, "events_dropped": self.dropped}


class StreamNormalizer:
    """One engine stream's keep/drop state: feed it each decoded batch in the stream's order (`admit`)."""

    def __init__(self) -> None:
        self._learned: dict[tuple[int, int], str] = {}
        self._salted: dict[tuple[int, int], object] = {}  # (dp rank, block hash) -> salt, or _AMBIGUOUS
        self._salts: set[int] = set()
        self.groups: dict[tuple[int, int], GroupSeen] = {}
        self.dropped: dict[str, int] = {}

    @property
    def salts_seen(self) -> int:
        """Distinct salts the stream's stores were hashed under (`MAX_SALTS` at most): the values are not kept."""
        return len(self._salts)

    def admit(self, dp_rank: int, events: list[EventData], filtered: Sequence[str] = ()
              ) -> tuple[list[EventData], list[Dropped]]:
        """The events Dynamo would index, in order, and the cause of each it would drop (or cut blocks of);
        `filtered`: the causes of those the decoder dropped already, counted with them."""
        kept: list[EventData] = []
        drops = [Dropped(cause) for cause in filtered]
        if not drops and not self._salted and all(map(_plain, events)):
            return events, drops  # the shape of a plain single-group stream: nothing to judge
        for event in events:
            cause, event = self._judge(dp_rank, event)
            if cause is not None:
                drops.append(cause)
                continue
            if type(event) is Stored and event.rehash is not None:  # its token ids go no further than here
                event = msgspec.structs.replace(event, rehash=None)
            if type(event) is Stored and event.cut is not None:
                drops.append(Dropped(event.cut))
                if event.block_hashes:
                    kept.append(event)
            else:
                kept.append(event)
        for cause in drops:
            self.dropped[cause.value] = self.dropped.get(cause.value, 0) + 1
        return kept, drops

    def forget_blocks(self) -> None:
        """The engine restarted, or cleared: the salts of the blocks it held are gone with them."""
        self._salted.clear()

    def _judge(self, dp_rank: int, event: EventData) -> tuple[Dropped | None, EventData]:
        """Why `event` is dropped (None: kept), and the event kept: a store that inherits a salt, hashed under it."""
        if type(event) is Cleared:
            self._salted = {k: v for k, v in self._salted.items() if k[0] != dp_rank} if self._salted else {}
            return None, event
        assert isinstance(event, Stored | Removed)
        if event.tier in _LOWER:
            return None, event
        group = event.group
        if group is not None:
            if type(event) is Stored and group.idx is not None and group.kind is not None:
                self._learn(dp_rank, group)
            cause = self._group_drop(dp_rank, group)
            self._count_group(dp_rank, group, cause)
            if cause is not None:
                return cause, event
        if type(event) is Stored:
            return self._salt_store(dp_rank, event)
        if self._salted:
            for block in event.block_hashes:
                key = (dp_rank, block)
                if key in self._salted and self._salted[key] is not _AMBIGUOUS:
                    del self._salted[key]
        return None, event

    def _learn(self, dp_rank: int, group: Group) -> None:
        assert group.idx is not None and group.kind is not None
        key = (dp_rank, group.idx)
        if key in self._learned or len(self._learned) < MAX_GROUPS:
            self._learned[key] = group.kind

    def _group_drop(self, dp_rank: int, group: Group) -> Dropped | None:
        kind = group.kind
        if kind is not None:
            return None if kind in MAIN_KINDS else \
                Dropped.non_main_attention_kind if kind in OTHER_KINDS else Dropped.unknown_kind
        if group.idx is None:
            return None
        learned = self._learned.get((dp_rank, group.idx))
        if learned is None:
            return None if group.idx == 0 else Dropped.unlearned_group_idx
        return None if learned in MAIN_KINDS else \
            Dropped.non_main_attention_group if learned in OTHER_KINDS else Dropped.unknown_kind

    def _count_group(self, dp_rank: int, group: Group, cause: Dropped | None) -> None:
        if group.idx is None:
            return
        key = (dp_rank, group.idx)
        seen = self.groups.get(key)
        if seen is None:
            if len(self.groups) >= MAX_GROUPS:
                return
            seen = self.groups[key] = GroupSeen(dp_rank, group.idx)
        seen.kind = group.kind or self._learned.get(key) or seen.kind
        seen.window = group.window if group.window is not None else seen.window
        if group.block_size is not None:
            seen.block_size = group.block_size
        if cause is None:
            seen.kept += 1
        else:
            seen.dropped += 1

    def _salt_store(self, dp_rank: int, event: Stored) -> tuple[Dropped | None, Stored]:
        salted = self._salted
        if event.salt is None and salted:
            parent = None if event.parent_hash is None else salted.get((dp_rank, event.parent_hash))
            if parent is _AMBIGUOUS:
                return Dropped.ambiguous_cache_namespace, event
            if isinstance(parent, str):
                if event.rehash is None:
                    return Dropped.uninherited_cache_namespace, event
                event = _inherit(event, event.rehash, parent)
            else:
                for block in event.block_hashes:
                    key = (dp_rank, block)
                    if key in salted:
                        salted[key] = _AMBIGUOUS
        salt = event.salt
        if salt is not None:
            if len(self._salts) < MAX_SALTS:
                self._salts.add(xxh3_64_intdigest(salt.encode("utf-8")))
            for block in event.block_hashes:
                key = (dp_rank, block)
                state = salted.get(key)
                if state is None:
                    if len(salted) < MAX_SALTED_BLOCKS:
                        salted[key] = salt
                elif state != salt:
                    salted[key] = _AMBIGUOUS
        return None, event


def _inherit(event: Stored, rehash: Rehash, salt: str) -> Stored:
    """`event` hashed under its parent's `salt`, as Dynamo's store inherits it; its local hashes as it had them
    (packed or a list)."""
    seed = block_seed(rehash.lora_name, salt)
    local = (eagle_block_hashes if rehash.eagle else block_hashes_of_packed)(rehash.tokens, rehash.block_size, seed)
    return msgspec.structs.replace(event, tokens_hashes=local if type(event.tokens_hashes) is array else
                                   local.tolist(), salt=salt, rehash=None)


def _plain(event: EventData) -> bool:
    """Whether Dynamo keeps `event` whatever came before it (given no salted block so far), as it is."""
    if type(event) is Stored:
        return event.group is None and event.salt is None and event.cut is None and event.rehash is None
    return not (isinstance(event, Removed) and event.group is not None)
