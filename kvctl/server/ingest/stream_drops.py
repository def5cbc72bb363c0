"""The events an engine stream decoded but Dynamo 1.6.1 would not index: judged by the stream's normalizer,
counted by cause, and logged once per cause, so that a dropped group or tier is never silent (docs/contract.md,
"Which engine events are indexed")."""

from __future__ import annotations

import logging

from kvctl.core.events import EngineBatch, EventData
from kvctl.core.events.engine_fields import Dropped
from kvctl.core.events.normalizer import StreamNormalizer

log = logging.getLogger(__name__)

_MEANING = {
    Dropped.unsupported_ownership: "blocks on a tier another process owns (ownership kvcr)",
    Dropped.unknown_ownership: "blocks with an ownership Dynamo does not know",
    Dropped.non_local_locality: "blocks on a remote tier (locality other than LOCAL)",
    Dropped.unknown_medium: "a medium Dynamo does not know (media are case-sensitive)",
    Dropped.non_main_attention_kind: "a KV cache group that is not full attention (sliding window, Mamba, ...)",
    Dropped.unknown_kind: "a kv_cache_spec_kind Dynamo does not know",
    Dropped.non_main_attention_group: "removes in a group the stream's stores said is not full attention",
    Dropped.unlearned_group_idx: "events of a group other than 0 whose kind no store has named",
    Dropped.ambiguous_cache_namespace: "an unsalted store under a block stored both salted and unsalted",
    Dropped.uninherited_cache_namespace: "an unsalted store under a salted block (Dynamo would inherit the salt; "
                                         "kvctl cannot rehash it)",
    Dropped.block_size_mismatch: "stores whose block size is not the model's: no block indexed",
    Dropped.short_tokens: "stores with fewer token ids than blocks: their last blocks not indexed",
    Dropped.self_reference: "stores that repeat a block hash: not indexed",
}


class StreamDrops:
    """One stream's normalizer, with what it dropped logged the first time each cause shows."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.normalizer = StreamNormalizer()
        self._logged: set[Dropped] = set()

    def admit(self, dp_rank: int, batch: EngineBatch) -> list[EventData]:
        """The batch's events Dynamo would index (of `dp_rank`, the batch's own or its stream's); the others
        counted (`normalizer.dropped`)."""
        events, drops = self.normalizer.admit(dp_rank, batch.events, batch.filtered)
        for cause in drops:
            if cause not in self._logged:
                self._logged.add(cause)
                log.warning("%s: dropping %s, as Dynamo does; counted in kvctl_stream_events_dropped{cause=%s}",
                            self.name, _MEANING[cause], cause.value)
        return events

    def status(self) -> dict[str, object]:
        """What `/v1/status` shows of the stream's drops and groups."""
        normalizer = self.normalizer
        return {"events_dropped": dict(normalizer.dropped), "salts_seen": normalizer.salts_seen,
                "groups": [g.row() for g in sorted(normalizer.groups.values(), key=lambda g: (g.dp_rank, g.idx))]}
