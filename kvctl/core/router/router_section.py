"""The `router:` section of Dynamo's `--router-policy-config` YAML, read as a 1.6.1 frontend reads it
(docs/contract.md, "The policy file"), and what kvctl's router makes of each setting.

1.6.1 reads the section twice. Its Python (`KvRouterConfigBase._router_settings`) loads the file with PyYAML
(YAML 1.1: `yes` is true, `1e3` a string), refuses an unknown key and converts each value to the type its config
declares (msgspec: an int passes as a float, nothing else converts); the values then go to Rust's
`KvRouterConfig`, which parses enums, reads the section again with serde_yaml (YAML 1.2: `yes` is a string, `.nan`
no f64) and checks ranges, then how settings combine. Both readings must pass; each refusal here is the first one
the frontend gives, in its words, naming the key where Dynamo's message does not. The settings win over the flags
and over the deprecated `--load-aware` preset (which, in 1.6.1, itself wins over the flags).

kvctl applies what its router has (`APPLIED`), notes what changes none of its decisions (`inert`), and refuses a
value that would make Dynamo decide in a way kvctl cannot (`kvctl_refusal`): its picks would no longer be the
frontend's. A setting at Dynamo's default needs nothing either way. Pure: the caller loads the YAML.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Setting:
    """One key: the type Dynamo's Python declares it with (msgspec's name for it), the type its Rust reads it
    as (serde's words), and Dynamo's default."""

    python: str
    rust: str
    default: Any


SETTINGS: dict[str, Setting] = {
    "host_cache_hit_weight": Setting("float", "f64", 0.75),
    "disk_cache_hit_weight": Setting("float", "f64", 0.25),
    "use_kv_events": Setting("bool", "a boolean", True),
    "router_replica_sync": Setting("bool", "a boolean", False),
    "router_track_active_blocks": Setting("bool", "a boolean", True),
    "router_track_output_blocks": Setting("bool", "a boolean", False),
    "router_assume_kv_reuse": Setting("bool", "a boolean", True),
    "router_track_prefill_tokens": Setting("bool", "a boolean", True),
    "router_tracking_hash": Setting("str", "a string", "public-xxh3-v1"),
    "router_tracking_key_file": Setting("str | null", "a string", None),
    "router_tracking_key_id": Setting("str | null", "a string", None),
    "router_prefill_load_model": Setting("str", "a string", "none"),
    "router_ttl_secs": Setting("float", "f64", 120.0),
    "router_approximate_cache_policy": Setting("str", "a string", "ttl"),
    "router_event_threads": Setting("int", "u32", 4),
    "use_remote_indexer": Setting("bool", "a boolean", False),
    "serve_indexer": Setting("bool", "a boolean", False),
    "enable_session_prefix_index": Setting("bool", "a boolean", False),
    "shared_cache_type": Setting("str", "a string", "none"),
    "router_predicted_ttl_secs": Setting("float | null", "f64", None),
}
"""Dynamo 1.6.1's `_ROUTER_SETTINGS`, in its order: the only keys the section may have."""

DEFAULTS: dict[str, Any] = {key: setting.default for key, setting in SETTINGS.items()}

APPLIED = ("host_cache_hit_weight", "disk_cache_hit_weight", "router_track_prefill_tokens", "use_kv_events",
           "router_replica_sync", "router_tracking_hash", "router_tracking_key_file", "router_tracking_key_id",
           "router_ttl_secs", "router_approximate_cache_policy")
"""Settings kvctl's router has (the first three are cost-function knobs; `serve` maps the rest to its options)."""

KNOB_NAMES = {"host_cache_hit_weight": "host_cache_hit_weight", "disk_cache_hit_weight": "disk_cache_hit_weight",
              "router_track_prefill_tokens": "track_prefill_tokens"}
"""The section's cost-function settings by their name in kvctl's `KNOBS`."""

_ENUMS = {  # checked by Rust as the frontend passes them on, in this order, before the section is read again
    "router_tracking_hash": ("public-xxh3-v1", "keyed-xxh3-v1"),
    "router_prefill_load_model": ("none", "aic", "ais"),
    "shared_cache_type": ("none", "hicache"),
    "router_approximate_cache_policy": ("ttl", "lru"),
}
_NOT_YET = "not implemented in kvctl yet"
_REFUSED = {  # a value other than Dynamo's default that would change decisions kvctl cannot make
    "router_track_active_blocks": f"a router tracking no active blocks is {_NOT_YET}",
    "router_track_output_blocks": f"tracking output blocks is {_NOT_YET}",
    "router_assume_kv_reuse": f"booking without KV reuse (random block hashes) is {_NOT_YET}",
    "router_prefill_load_model": f"the AIS prefill load model is {_NOT_YET}",
    "shared_cache_type": f"shared caches (HiCache) are {_NOT_YET}",
    "router_predicted_ttl_secs": f"predict-on-route (predicted blocks with a TTL) is {_NOT_YET}",
}
_INERT = {  # a value other than Dynamo's default that changes none of kvctl's decisions
    "router_event_threads": "kvctl's index has one writer per model: no effect",
    "use_remote_indexer": "kvctl routes on its own index of the fleet's KV events, which equals the workers'",
    "serve_indexer": "kvctl serve always serves its index (GET /v1/tree), not on Dynamo's request plane",
    "enable_session_prefix_index": "Dynamo 1.6.1's session prefix index feeds no routing decision: no effect",
}
_U32_MAX = (1 << 32) - 1


class RouterSectionError(ValueError):
    """A `router:` section the frontend would refuse to start with; the message is one line."""


def _python_type(value: Any) -> str:
    """msgspec's name for a value's type, as its `Expected …, got …` says it."""
    if value is None:
        return "null"
    if isinstance(value, datetime.datetime | datetime.date):
        return type(value).__name__
    for kind, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str"), (bytes, "bytes"),
                       (list, "array"), (dict, "object")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _convert(key: str, value: Any) -> Any:
    """Dynamo's Python conversion (msgspec `convert`, strict): an int becomes a float where one is declared."""
    declared = SETTINGS[key].python
    if value is None and declared.endswith("| null"):
        return None
    kind = declared.removesuffix(" | null")
    if kind == "float" and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if (kind, _python_type(value)) in (("bool", "bool"), ("int", "int"), ("str", "str")):
        return value
    raise RouterSectionError(f"invalid router settings: Expected `{declared}`, got `{_python_type(value)}` - at "
                             f"`$.{key}`")


def _serde_unexpected(value: Any) -> str:
    """serde's words for a value it did not expect."""
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value!r}`"
    if isinstance(value, str):
        return f'string "{value}"'
    return "sequence" if isinstance(value, list) else "map"


def _rust_value_error(key: str, value: Any) -> str | None:
    """serde_yaml's refusal of the YAML 1.2 reading of a value, or None. Only where YAML 1.1 and 1.2 disagree can
    it refuse what Dynamo's Python took: `yes` (a string), `1_000` (a string), `.nan` (no f64: read as null)."""
    setting = SETTINGS[key]
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None if setting.default is None else f"invalid type: null, expected {setting.rust}"
    number = isinstance(value, int | float) and not isinstance(value, bool)
    fits = {"f64": number, "u32": number and isinstance(value, int), "a boolean": isinstance(value, bool),
            "a string": isinstance(value, str)}
    return None if fits[setting.rust] else f"invalid type: {_serde_unexpected(value)}, expected {setting.rust}"


def shown(value: Any) -> str:
    """A setting's value as the YAML would spell it (true, null, 0.5, lru)."""
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


def _range_error(settings: Mapping[str, Any]) -> str | None:
    """Rust's range checks (its validator), in the order it reports them."""
    for key in ("host_cache_hit_weight", "disk_cache_hit_weight"):
        if key in settings and not 0 <= settings[key] <= 1:
            return f"{key} must be between 0 and 1"
    for key in ("router_ttl_secs", "router_predicted_ttl_secs"):
        if settings.get(key) is not None and not settings[key] >= 0:
            return f"{key} must be greater than or equal to 0"
    if settings.get("router_event_threads", 1) < 1:
        return "router_event_threads must be at least 1"
    return None


def _enum_error(key: str, value: str) -> str:
    """Rust's refusal of a value its enum has no variant for, as it parses the value the frontend passes on."""
    if key == "router_tracking_hash":
        return f'router_tracking_hash must be public-xxh3-v1 or keyed-xxh3-v1, got "{value}"'
    if key == "router_prefill_load_model":
        return f"unknown prefill load model: \"{value}\", expected 'none' or 'ais'"
    if key == "shared_cache_type":
        return f"unknown shared_cache_type: \"{value}\", expected 'none' or 'hicache'"
    return f"unknown approximate cache policy \"{value}\", expected 'ttl' or 'lru'"


def parse_router_section(loose: Any, strict: Any) -> dict[str, Any]:
    """The section's settings by Dynamo name, as given and converted; RouterSectionError where the frontend
    refuses them. `loose`: the section as PyYAML reads it (YAML 1.1); `strict`: as YAML 1.2 reads it."""
    if not isinstance(loose, dict):
        raise RouterSectionError("router must contain a YAML mapping")
    unknown = sorted(str(key) for key in loose if key not in SETTINGS)
    if unknown:
        raise RouterSectionError(f"unknown router setting(s): {unknown}")
    settings = {key: _convert(key, value) for key, value in loose.items()}
    if settings.get("serve_indexer") and settings.get("use_remote_indexer"):
        raise RouterSectionError("--serve-indexer and --use-remote-indexer are mutually exclusive")
    threads = settings.get("router_event_threads", 1)
    if not 0 <= threads <= _U32_MAX:
        raise RouterSectionError("out of range integral type conversion attempted - at `$.router_event_threads` "
                                 "(a u32)")
    for key, allowed in _ENUMS.items():
        if key in settings and settings[key] not in allowed:
            raise RouterSectionError(_enum_error(key, settings[key]))
    for key, value in (strict if isinstance(strict, dict) else {}).items():
        error = _rust_value_error(key, value) if key in SETTINGS else None
        if error is not None:
            raise RouterSectionError(f"invalid router policy config: router.{key}: {error}")
    error = _range_error(settings)
    if error is not None:
        raise RouterSectionError(error)
    return settings


def combination_error(settings: Mapping[str, Any]) -> str | None:
    """How Dynamo refuses settings that do not go together, in its words and order, or None. `settings`: every
    key's effective value (the section over the flags over Dynamo's defaults): the checks are on the whole config."""
    keyed = settings["router_tracking_hash"] == "keyed-xxh3-v1"
    key_id = settings["router_tracking_key_id"]
    if not keyed and (settings["router_tracking_key_file"] is not None or key_id is not None):
        return "router tracking key options require router_tracking_hash=keyed-xxh3-v1"
    if keyed and settings["router_tracking_key_file"] is None:
        return "keyed-xxh3-v1 requires router_tracking_key_file"
    if keyed and not (key_id and key_id.strip() == key_id):
        return "keyed-xxh3-v1 requires a nonempty router_tracking_key_id"
    if settings["router_track_output_blocks"] and not settings["router_track_active_blocks"]:
        return "router_track_output_blocks requires router_track_active_blocks=true"
    if settings["router_prefill_load_model"] != "none" and not settings["router_track_prefill_tokens"]:
        return "router_prefill_load_model requires router_track_prefill_tokens=true"
    if settings["enable_session_prefix_index"] and not settings["use_kv_events"]:
        return "enable_session_prefix_index requires use_kv_events=true"
    if settings["router_predicted_ttl_secs"] is not None and not settings["use_kv_events"]:
        return "router_predicted_ttl_secs requires use_kv_events=true"
    if settings["router_approximate_cache_policy"] == "lru" and settings["use_kv_events"]:
        return "router_approximate_cache_policy=lru requires use_kv_events=false; the local side indexer is TTL-only"
    return None


def kvctl_refusal(section: Mapping[str, Any]) -> str | None:
    """Why kvctl cannot route as the frontend would with this section (the first such setting), or None."""
    for key, why in _REFUSED.items():
        if key in section and section[key] != DEFAULTS[key]:
            return f"router.{key}: {shown(section[key])} is not taken by kvctl serve: {why}"
    return None


def inert(section: Mapping[str, Any]) -> list[str]:
    """One line per setting that kvctl takes but that changes none of its decisions: the key and why."""
    return [f"router.{key}: {shown(section[key])}: {why}" for key, why in _INERT.items()
            if key in section and section[key] != DEFAULTS[key]]


def knobs(section: Mapping[str, Any]) -> dict[str, float | bool]:
    """The section's cost-function settings, by kvctl's knob names."""
    return {KNOB_NAMES[key]: section[key] for key in KNOB_NAMES if key in section}
