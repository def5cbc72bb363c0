"""The stream normalizer keeps and drops what Dynamo 1.6.1's standalone indexer keeps and drops: each case here is
a stream observed on the running indexer (docs/contract.md, "Which engine events are indexed"), written as the
events kvctl's decoder makes of it. The fixtures' whole streams are checked against the indexer itself in
tests/interop/test_engine_streams_dynamo.py."""

from __future__ import annotations

from kvctl.core.events import Cleared, EventData, Group, Rehash, Removed, Stored, Tier
from kvctl.core.events.engine_fields import Dropped
from kvctl.core.events.normalizer import StreamNormalizer
from kvctl.core.hashing import local_block_hashes, pack_tokens

HASHES = [11, 12, 13, 14, 15]
LOCAL = [21, 22, 23, 24, 25]


def store(group: Group | None = None, *, tier: Tier = Tier.device, salt: str | None = None,
          hashes: list[int] = HASHES, parent: int | None = None) -> Stored:
    return Stored(parent, hashes, LOCAL[: len(hashes)], tier, group, salt)


def remove(group: Group | None = None, *, tier: Tier = Tier.device, hashes: list[int] = HASHES[:3]) -> Removed:
    return Removed(hashes, tier, group)


def run(*batches: tuple[int, list[EventData]]) -> tuple[StreamNormalizer, list[EventData], list[Dropped]]:
    normalizer = StreamNormalizer()
    kept: list[EventData] = []
    drops: list[Dropped] = []
    for dp_rank, events in batches:
        k, d = normalizer.admit(dp_rank, events)
        kept += k
        drops += d
    return normalizer, kept, drops


FULL, SWA = "full_attention", "sliding_window"


def test_a_sliding_window_group_moving_does_not_empty_the_index() -> None:
    """GPT-OSS: g0 full, g1 sliding window; g1's removes (group_idx only, as vLLM sends them) are dropped."""
    _, kept, drops = run((0, [store(Group(0, FULL, None, 4)), store(Group(1, SWA, 128, 4))]),
                         (0, [remove(Group(1))]))
    assert kept == [store(Group(0, FULL, None, 4))]
    assert drops == [Dropped.non_main_attention_kind, Dropped.non_main_attention_group]


def test_the_kind_says_which_group_is_full_whatever_the_order() -> None:
    _, kept, drops = run((0, [store(Group(0, SWA, 128)), store(Group(1, FULL))]), (0, [remove(Group(0))]))
    assert kept == [store(Group(1, FULL))]
    assert drops == [Dropped.non_main_attention_kind, Dropped.non_main_attention_group]


def test_without_kinds_group_zero_is_indexed_whatever_it_is() -> None:
    _, kept, drops = run((0, [store(Group(0)), store(Group(1))]), (0, [remove(Group(1)), remove(Group(0))]))
    assert kept == [store(Group(0)), remove(Group(0))]
    assert drops == [Dropped.unlearned_group_idx, Dropped.unlearned_group_idx]


def test_groups_are_learned_per_dp_rank() -> None:
    _, kept, drops = run((0, [store(Group(0, SWA))]), (1, [store(Group(0))]))
    assert kept == [store(Group(0))]
    assert drops == [Dropped.non_main_attention_kind]


def test_an_events_own_kind_wins_over_what_was_learned() -> None:
    _, kept, drops = run((0, [store(Group(0, FULL)), remove(Group(0, SWA))]))
    assert kept == [store(Group(0, FULL))]
    assert drops == [Dropped.non_main_attention_kind]


def test_every_main_kind_is_indexed_and_an_unknown_kind_is_not() -> None:
    events: list[EventData] = [store(Group(i, kind)) for i, kind in enumerate(
        ["full_attention", "mla_attention", "sink_full_attention", "chunked_local_attention", "cross_attention",
         "mamba", "brand_new_kind"])]
    normalizer, kept, drops = run((0, events))
    assert kept == events[:3]
    assert drops == [Dropped.non_main_attention_kind] * 3 + [Dropped.unknown_kind]
    assert normalizer.dropped == {"non_main_attention_kind": 3, "unknown_kind": 1}


def test_removes_in_a_learned_full_group_apply() -> None:
    """Two full groups are both indexed: a remove from either removes the block."""
    _, kept, drops = run((0, [store(Group(0, FULL)), store(Group(1, FULL)), remove(Group(1))]))
    assert kept[-1] == remove(Group(1)) and drops == []


def test_disk_and_external_skip_the_group_filter_host_pinned_does_not() -> None:
    _, kept, drops = run((0, [store(Group(1, SWA), tier=Tier.disk), remove(Group(1), tier=Tier.external),
                              store(Group(1, SWA), tier=Tier.host_pinned)]))
    assert kept == [store(Group(1, SWA), tier=Tier.disk), remove(Group(1), tier=Tier.external)]
    assert drops == [Dropped.non_main_attention_kind]


def test_group_stats_say_what_each_group_is_and_what_it_lost() -> None:
    normalizer, _, _ = run((0, [store(Group(0, FULL, None, 16)), store(Group(1, SWA, 128, 16))]),
                           (0, [remove(Group(1)), remove(Group(1)), remove(Group(0))]))
    assert [g.row() for g in normalizer.groups.values()] == [
        {"dp_rank": 0, "group_idx": 0, "kind": FULL, "sliding_window": None, "block_size": 16, "events_kept": 2,
         "events_dropped": 0},
        {"dp_rank": 0, "group_idx": 1, "kind": SWA, "sliding_window": 128, "block_size": 16, "events_kept": 0,
         "events_dropped": 3}]


def test_a_salted_store_is_kept_and_its_salt_counted_not_kept() -> None:
    normalizer, kept, drops = run((0, [store(salt="tenant-42"), store(salt="tenant-7", hashes=[99])]))
    assert len(kept) == 2 and drops == [] and normalizer.salts_seen == 2


def test_an_unsalted_child_of_a_salted_block_inherits_the_salt_as_in_dynamo() -> None:
    """vLLM names a salted request's salt in its first block only; the next chunk is hashed under the parent's salt
    from the token ids the decoder kept, which go no further than the normalizer."""
    tokens = list(range(1, 33))
    packed = pack_tokens(tokens).tobytes()
    child = Stored(2, [3, 4], local_block_hashes(tokens, 16), rehash=Rehash(packed, 16, "ad", False))
    _, kept, drops = run((0, [store(salt="s1", hashes=[1, 2]), child, store(parent=4, hashes=[5])]))
    inherited = Stored(2, [3, 4], local_block_hashes(tokens, 16, lora_name="ad", cache_salt="s1"), salt="s1")
    assert kept[:2] == [store(salt="s1", hashes=[1, 2]), inherited] and drops == [Dropped.uninherited_cache_namespace]


def test_an_unsalted_child_of_a_salted_block_without_its_tokens_is_dropped_not_indexed_unsalted() -> None:
    """Without its token ids (the decode process sends them once its stream stored salted blocks), a store cannot
    be hashed under the inherited salt: dropped and counted, never indexed under the wrong hashes."""
    _, kept, drops = run((0, [store(salt="s1", hashes=[1, 2]), store(parent=2, hashes=[3])]))
    assert kept == [store(salt="s1", hashes=[1, 2])]
    assert drops == [Dropped.uninherited_cache_namespace]


def test_a_block_stored_both_salted_and_unsalted_is_ambiguous() -> None:
    _, kept, drops = run((0, [store(salt="s1", hashes=[1, 2]), store(hashes=[1, 2]), store(parent=2, hashes=[3])]))
    assert kept == [store(salt="s1", hashes=[1, 2]), store(hashes=[1, 2])]
    assert drops == [Dropped.ambiguous_cache_namespace]


def test_a_salted_child_of_an_unsalted_parent_and_an_unknown_parent_are_kept() -> None:
    _, kept, drops = run((0, [store(hashes=[1]), store(salt="s1", parent=1, hashes=[2]), store(parent=77,
                                                                                                 hashes=[3])]))
    assert len(kept) == 3 and drops == []


def test_removes_and_clears_forget_salts() -> None:
    _, kept, drops = run((0, [store(salt="s1", hashes=[1, 2]), remove(hashes=[2]), store(parent=2, hashes=[3])]),
                         (0, [store(salt="s1", hashes=[5]), Cleared(), store(parent=5, hashes=[6])]))
    assert drops == [] and len(kept) == 6
    normalizer, _, drops = run((1, [store(salt="s1", hashes=[5])]), (0, [Cleared()]), (1, [store(parent=5,
                                                                                                 hashes=[6])]))
    assert drops == [Dropped.uninherited_cache_namespace]  # a clear is its DP rank's only
    normalizer.forget_blocks()
    assert normalizer.admit(1, [store(parent=5, hashes=[6])]) == ([store(parent=5, hashes=[6])], [])


def test_lower_tiers_skip_salt_propagation() -> None:
    _, kept, drops = run((0, [store(salt="s1", hashes=[1]), store(parent=1, hashes=[2], tier=Tier.disk)]))
    assert len(kept) == 2 and drops == []


def test_what_the_decoder_cut_is_counted_and_an_emptied_store_not_passed_on() -> None:
    short = Stored(None, [1], [21], group=Group(0, FULL), cut="short_tokens", cut_blocks=2)
    mismatched = Stored(None, [], [], group=Group(1, "mamba", None, 320), cut="block_size_mismatch", cut_blocks=1)
    emptied = Stored(None, [], [], cut="block_size_mismatch", cut_blocks=3)
    normalizer, kept, drops = run((0, [short, mismatched, emptied]))
    assert kept == [short]
    assert drops == [Dropped.short_tokens, Dropped.non_main_attention_kind, Dropped.block_size_mismatch]
    assert normalizer.groups[(0, 1)].kind == "mamba"  # a Mamba group's store still says what the group is


def test_decoder_drops_are_counted_with_the_rest() -> None:
    normalizer = StreamNormalizer()
    assert normalizer.admit(0, [store()], ["non_local_locality", "unsupported_ownership"]) == (
        [store()], [Dropped.non_local_locality, Dropped.unsupported_ownership])
    assert normalizer.dropped == {"non_local_locality": 1, "unsupported_ownership": 1}


def test_token_ids_kept_for_a_salt_go_no_further() -> None:
    kept, _ = StreamNormalizer().admit(0, [Stored(None, [1], [21], rehash=Rehash(b"\0" * 64, 16, None, False))])
    assert kept == [Stored(None, [1], [21])]


def test_a_plain_stream_passes_through_untouched() -> None:
    events: list[EventData] = [store(), remove(), Cleared()]
    normalizer = StreamNormalizer()
    kept, drops = normalizer.admit(0, events)
    assert kept is events and drops == [] and normalizer.groups == {} and normalizer.dropped == {}
