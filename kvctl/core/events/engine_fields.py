"""What an engine event says besides its blocks, read as Dynamo 1.6.1's ZMQ normalizer reads it (docs/contract.md,
"Which engine events are indexed"): where its blocks live (`medium`, `locality`, `ownership`), which KV cache group
they belong to (vLLM's hybrid models), and which cache salt and token shape (SGLang's EAGLE pairs) they hash under.

Everything here is decided by one event alone; what needs the stream's history (learned groups, inherited salts)
is `kvctl.core.events.normalizer`. An event Dynamo would not index is not an error: it is dropped and counted by
its `Dropped` cause, which are Dynamo's own filter labels where Dynamo has one.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Any

from kvctl.core.events.errors import DecodeError, ErrorKind, describe
from kvctl.core.events.types import Group, Tier

__all__ = ["MEDIUM_TIERS", "SALT_PREFIX", "Dropped", "cache_salt_of", "eagle_tokens", "group_of", "residency_drop",
           "tier_of_medium"]

_U32_LIMIT = 1 << 32
SALT_PREFIX = "dynamo-cache-salt:"
"""How Dynamo's vLLM worker tags a cache salt it hands vLLM, which publishes it in the first block's `extra_keys`."""


class Dropped(StrEnum):
    """Why an engine event was not indexed although it decoded; the values are stable metric labels."""

    unsupported_ownership = "unsupported_ownership"  # `ownership` "kvcr": a tier another process owns
    unknown_ownership = "unknown_ownership"  # any other `ownership`
    non_local_locality = "non_local_locality"  # `locality` other than LOCAL: a remote tier
    unknown_medium = "unknown_medium"  # a `medium` outside Dynamo's table (it is case-sensitive)
    non_main_attention_kind = "non_main_attention_kind"  # a sliding-window, Mamba, ... group, by its own kind
    unknown_kind = "unknown_kind"  # a `kv_cache_spec_kind` Dynamo does not know
    non_main_attention_group = "non_main_attention_group"  # a remove in a group learned to be non-main
    unlearned_group_idx = "unlearned_group_idx"  # a group other than 0 whose kind no store has said
    ambiguous_cache_namespace = "ambiguous_cache_namespace"  # an unsalted store under a block stored both ways
    uninherited_cache_namespace = "uninherited_cache_namespace"  # an unsalted store under a salted block
    block_size_mismatch = "block_size_mismatch"  # the store's block size is not its model's
    short_tokens = "short_tokens"  # fewer token ids than the store's blocks (its last blocks are dropped)
    self_reference = "self_reference"  # a block hash repeated within one store


GROUP_DROPS = frozenset({Dropped.non_main_attention_kind, Dropped.unknown_kind, Dropped.non_main_attention_group,
                         Dropped.unlearned_group_idx})
"""The causes that come from a hybrid model's groups: Dynamo indexes its full-attention groups only."""

MEDIUM_TIERS: dict[str, Tier] = {
    "": Tier.device,
    "GPU": Tier.device,
    "DEVICE": Tier.device,
    "CPU": Tier.host_pinned,
    "CPU_PINNED": Tier.host_pinned,
    "CPU_TIER1": Tier.host_pinned,
    "CPU_TIER2": Tier.disk,
    "DISK": Tier.disk,
    "NVME": Tier.disk,
    "STORAGE": Tier.disk,
    "EXTERNAL": Tier.external,
    "NETWORK": Tier.external,
    "REMOTE": Tier.external,
    "SHARED": Tier.external,
}
"""Dynamo's `StorageTier::from_kv_medium`, exactly: no medium (or "") is the device; "gpu" is no medium it knows."""


def tier_of_medium(medium: object) -> Tier | None:
    """The tier of an engine `medium`, or None for a string Dynamo does not know (the event is then dropped)."""
    if medium is None:
        return Tier.device
    if not isinstance(medium, str):
        raise DecodeError(ErrorKind.bad_tier, "medium", f"expected a string, got {describe(medium)}")
    return MEDIUM_TIERS.get(medium)


def residency_drop(locality: object, ownership: object) -> Dropped | None:
    """Why Dynamo drops an event for where its blocks live, or None: it indexes the local, unowned tiers only."""
    if ownership is not None:
        if not isinstance(ownership, str):
            raise DecodeError(ErrorKind.bad_type, "ownership", f"expected a string, got {describe(ownership)}")
        return Dropped.unsupported_ownership if ownership == "kvcr" else Dropped.unknown_ownership
    if locality is None or locality == "LOCAL":
        return None
    if not isinstance(locality, str):
        raise DecodeError(ErrorKind.bad_type, "locality", f"expected a string, got {describe(locality)}")
    return Dropped.non_local_locality


def group_of(idx: object, kind: object, window: object = None, block_size: object = None) -> Group | None:
    """The group an event names (None when it names none: a single-group engine, SGLang)."""
    if idx is None and kind is None:
        return None
    if idx is not None and (type(idx) is not int or not 0 <= idx < _U32_LIMIT):
        raise DecodeError(ErrorKind.bad_type, "group_idx", f"expected a u32, got {describe(idx)}")
    if kind is not None and not isinstance(kind, str):
        raise DecodeError(ErrorKind.bad_type, "kv_cache_spec_kind", f"expected a string, got {describe(kind)}")
    return Group(idx, kind, window if type(window) is int else None,
                 block_size if type(block_size) is int else None)


def cache_salt_of(cache_salt: object, extra_keys: object, lora_name: str | None) -> str | None:
    """The salt a store's blocks hash under: its `cache_salt` (SGLang), else a Dynamo-tagged salt among its first
    block's `extra_keys` (vLLM behind Dynamo), skipping the first key equal to its LoRA name; "" is none."""
    if cache_salt is not None:
        if not isinstance(cache_salt, str):
            raise DecodeError(ErrorKind.bad_type, "cache_salt", f"expected a string, got {describe(cache_salt)}")
        if cache_salt:
            return cache_salt
    if not isinstance(extra_keys, list) or not extra_keys or not isinstance(extra_keys[0], list):
        return None
    lora = lora_name or None
    for key in extra_keys[0]:
        if not isinstance(key, str):
            continue
        if key == lora:
            lora = None
        elif key.startswith(SALT_PREFIX) and len(key) > len(SALT_PREFIX):
            return key[len(SALT_PREFIX):]
    return None


def eagle_tokens(pairs: Sequence[Any]) -> list[int] | None:
    """The tokens of an EAGLE store (SGLang's bigram pages: `[t_i, t_i+1]` pairs): each pair's first token, then the
    last pair's second; None when `pairs` is not all pairs, and the caller reads it as plain token ids."""
    if not pairs:
        return None
    for pair in pairs:
        if type(pair) is not list or len(pair) != 2:
            return None
    tokens = [pair[0] for pair in pairs]
    tokens.append(pairs[-1][1])
    return tokens
