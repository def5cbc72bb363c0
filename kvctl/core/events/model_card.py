"""Dynamo 1.6.1's model cards (docs/contract.md): what each worker instance serves, as its router reads it.

Every worker files one card under `v1/mdc/{namespace}/{component}/{endpoint}/{instance_id hex}` (etcd: that key;
file discovery: the file `v1/mdc/<the rest, percent-encoded>`; Kubernetes: `spec.data.model_cards`, keyed by the
rest). Dynamo's router takes from it the model's name (`display_name`), its block size (`kv_cache_block_size`),
each worker's KV capacity (`runtime_config.total_kv_blocks`, for the busy thresholds), its role (`worker_type`:
aggregated, prefill or decode) and its data-parallel ranks. Parsing only: the listing is the server's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvctl.core.events.errors import DecodeError, ErrorKind, as_map, as_text, describe, parse_json, require
from kvctl.core.names import Role
from kvctl.core.words import counted

CARDS_BUCKET = "v1/mdc"
ROLES = tuple(Role)
_U64_MAX = (1 << 64) - 1
_KEY_REST = re.compile(r"^[^/]+/[^/]+/[^/]+/[0-9a-f]{1,16}$")


def cards_prefix(namespace: str) -> str:
    """The key prefix of every model card of a namespace."""
    return f"{CARDS_BUCKET}/{namespace}/"


def is_card_key_rest(rest: str) -> bool:
    """Whether `rest` (a key less its `v1/mdc/` bucket) has a card key's layout: `ns/component/endpoint/hex`."""
    return _KEY_REST.match(rest) is not None


@dataclass(frozen=True, slots=True)
class ModelCard:
    """One worker instance's card, the fields a router uses."""

    instance_id: int  # the worker id of its events and of Dynamo's router
    namespace: str
    component: str
    endpoint: str
    model: str  # display_name: the name /v1/models lists and the frontend routes by
    block_size: int | None  # kv_cache_block_size
    total_kv_blocks: int | None  # the worker's KV capacity
    max_num_batched_tokens: int | None  # what the prefill busy and queue thresholds are fractions of
    role: Role
    publishes_kv_events: bool  # decode workers of a disaggregated fleet publish none, by design
    dp_start: int
    dp_size: int
    eagle: bool = False  # runtime_config.enable_eagle: the engine's blocks hash EAGLE-style (`eagle_block_hashes`)

    @property
    def ranks(self) -> range:
        return range(self.dp_start, self.dp_start + self.dp_size)


def disaggregated_roles(roles: Mapping[str, int]) -> str:
    """A disaggregated model's pools as its cards give them: "2 prefill workers and 2 decode workers"."""
    prefill, decode = counted(roles.get("prefill", 0), "prefill worker"), counted(roles.get("decode", 0),
                                                                                 "decode worker")
    return f"{prefill} and {decode}"


def parse_model_card(data: bytes | str) -> ModelCard:
    """A card record (JSON). A record of another type is unknown_type; a missing or mistyped field the router
    needs is missing_field / bad_type. Fields it does not need are not checked."""
    obj = as_map(parse_json(data), "record")
    kind = require(obj, "type")
    if kind != "Model":
        raise DecodeError(ErrorKind.unknown_type, "type", f"expected Model, got {describe(kind)}")
    instance_id = require(obj, "instance_id")
    if type(instance_id) is not int or not 0 <= instance_id <= _U64_MAX:
        raise DecodeError(ErrorKind.bad_type, "instance_id", f"expected a u64, got {describe(instance_id)}")
    card = as_map(require(obj, "card_json"), "card_json")
    runtime = as_map(card.get("runtime_config") or {}, "card_json.runtime_config")
    role = card.get("worker_type") or "aggregated"
    if role not in ROLES:
        raise DecodeError(ErrorKind.bad_type, "card_json.worker_type", f"expected one of {', '.join(ROLES)}, got "
                                                                         f"{describe(role)}")
    publishes = _flag(runtime, "kv_event_publishing_enabled", True)
    return ModelCard(
        instance_id=instance_id,
        namespace=as_text(require(obj, "namespace"), "namespace"),
        component=as_text(require(obj, "component"), "component"),
        endpoint=as_text(require(obj, "endpoint"), "endpoint"),
        model=as_text(require(card, "display_name", "card_json.display_name"), "card_json.display_name"),
        block_size=_count(card.get("kv_cache_block_size"), "card_json.kv_cache_block_size", positive=True),
        total_kv_blocks=_count(runtime.get("total_kv_blocks"), "card_json.runtime_config.total_kv_blocks",
                               positive=True),
        max_num_batched_tokens=_count(runtime.get("max_num_batched_tokens"),
                                      "card_json.runtime_config.max_num_batched_tokens", positive=True),
        role=Role(role),
        publishes_kv_events=publishes,
        dp_start=_count(runtime.get("data_parallel_start_rank"), "data_parallel_start_rank") or 0,
        dp_size=_count(runtime.get("data_parallel_size"), "data_parallel_size", positive=True) or 1,
        eagle=_flag(runtime, "enable_eagle", False),
    )


def _flag(runtime: Mapping[str, Any], key: str, default: bool) -> bool:
    value = runtime.get(key, default)
    if type(value) is not bool:
        raise DecodeError(ErrorKind.bad_type, f"card_json.runtime_config.{key}",
                          f"expected a bool, got {describe(value)}")
    return value


def _count(value: Any, field: str, *, positive: bool = False) -> int | None:
    """An optional non-negative (or positive) integer field; null means not advertised."""
    if value is None:
        return None
    if type(value) is not int or value < (1 if positive else 0) or value > _U64_MAX:
        raise DecodeError(ErrorKind.bad_type, field, f"expected a {'positive' if positive else 'non-negative'} "
                                                     f"integer, got {describe(value)}")
    return value

