"""How `kvctl serve`'s routing flags become the router's config: the cost function's knobs, the deprecated
--tier-credits, and Dynamo's --router-policy-config (its `router:` section and its aggregated worker-selection
instance), in Dynamo's order of precedence: the file's settings over the flags."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvctl.core.router.approx_lru import CachePolicy
from kvctl.errors import UsageError

if TYPE_CHECKING:
    from kvctl.core.router.policy_classes import QueueProfiles
    from kvctl.core.router.policy_config import PolicyConfig
    from kvctl.core.router.queue import RouterQueue
    from kvctl.core.router.scoring import RouterConfig
    from kvctl.core.tracking_hash import TrackingKey

log = logging.getLogger("kvctl.serve")


class TrackingHash(StrEnum):
    public = "public-xxh3-v1"
    keyed = "keyed-xxh3-v1"


def tracking_key(algorithm: TrackingHash, key_file: Path | None, key_id: str | None) -> TrackingKey | None:
    """The key of --router-tracking-hash keyed-xxh3-v1, checked as Dynamo checks it; None for public hashes.
    UsageError (exit 2) for a key option without keyed hashes, a missing one with them, or a bad key."""
    if algorithm is TrackingHash.public:
        if key_file is not None or key_id is not None:
            raise UsageError("--router-tracking-key-file and --router-tracking-key-id go with --router-tracking-hash "
                             "keyed-xxh3-v1")
        return None
    if key_file is None or key_id is None:
        raise UsageError("--router-tracking-hash keyed-xxh3-v1 needs --router-tracking-key-file and "
                         "--router-tracking-key-id, as the frontend is given them")
    from kvctl.core.tracking_hash import TrackingKey

    try:
        return TrackingKey.read(key_file, key_id)
    except OSError as exc:
        raise UsageError(f"--router-tracking-key-file: cannot read {str(key_file)!r}: {exc.strerror}") from None
    except ValueError as exc:
        raise UsageError(f"--router-tracking-key-file {str(key_file)!r}: {exc}") from None


def parse_tier_credits(text: str) -> dict[str, float]:
    """The deprecated --tier-credits ('default' or 'host_pinned=W,disk=W') as Dynamo's tier weights."""
    from kvctl.core.router.scoring import RouterConfig

    if text == "default":
        defaults = RouterConfig()
        return {"host_cache_hit_weight": defaults.host_cache_hit_weight,
                "disk_cache_hit_weight": defaults.disk_cache_hit_weight}
    weights = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        knob = {"host_pinned": "host_cache_hit_weight", "disk": "disk_cache_hit_weight"}.get(name.strip())
        try:
            if knob is None:
                raise ValueError(name)
            weights[knob] = float(value)
        except ValueError:
            raise UsageError(f"--tier-credits: bad item {item!r} (deprecated: use --host-cache-hit-weight and "
                             "--disk-cache-hit-weight; Dynamo gives other tiers no credit)",
                             hint="e.g. host_pinned=0.75,disk=0.25, or 'default'") from None
    return weights


@dataclass(frozen=True, slots=True)
class FleetOptions:
    """`serve`'s options that a policy file's `router:` section also sets, beside the cost-function knobs."""

    approximate: bool
    router_ttl: float
    cache_policy: CachePolicy
    tracking_hash: TrackingHash
    tracking_key_file: Path | None
    tracking_key_id: str | None
    replica_sync: bool

    def as_dynamo(self, track_prefill_tokens: bool | None) -> dict[str, Any]:
        """These options (and the prefill-tracking flag) as Dynamo's router settings, its defaults for the rest."""
        from kvctl.core.router.router_section import DEFAULTS

        return {**DEFAULTS, "use_kv_events": not self.approximate, "router_ttl_secs": self.router_ttl,
                "router_approximate_cache_policy": self.cache_policy.value,
                "router_tracking_hash": self.tracking_hash.value,
                "router_tracking_key_file": None if self.tracking_key_file is None else str(self.tracking_key_file),
                "router_tracking_key_id": self.tracking_key_id, "router_replica_sync": self.replica_sync,
                "router_track_prefill_tokens": track_prefill_tokens is not False}

    def with_settings(self, settings: dict[str, Any]) -> FleetOptions:
        """These options with Dynamo's settings (a `router:` section's) over them."""
        file = settings.get("router_tracking_key_file", self.tracking_key_file)
        return dataclasses.replace(
            self, approximate=not settings.get("use_kv_events", not self.approximate),
            router_ttl=settings.get("router_ttl_secs", self.router_ttl),
            cache_policy=CachePolicy(settings.get("router_approximate_cache_policy", self.cache_policy)),
            tracking_hash=TrackingHash(settings.get("router_tracking_hash", self.tracking_hash)),
            tracking_key_file=None if file is None else Path(file),
            tracking_key_id=settings.get("router_tracking_key_id", self.tracking_key_id),
            replica_sync=settings.get("router_replica_sync", self.replica_sync))


def read_policy(path: Path | None) -> PolicyConfig | None:
    """The policy file as Dynamo 1.6.1 reads it (None without one), its unused sections named in a warning.
    UsageError (exit 2) for a file that cannot be read or that Dynamo would refuse, with its reason on one line."""
    if path is None:
        return None
    from kvctl.core.router.policy_config import PolicyConfigError, parse_policy_config  # YAML: loaded if asked

    try:
        policy = parse_policy_config(path.read_text())
    except OSError as exc:
        raise UsageError(f"--router-policy-config: failed to read router policy config {path}: "
                         f"{exc.strerror}") from None
    except (PolicyConfigError, UnicodeDecodeError) as exc:
        raise UsageError(f"--router-policy-config {path}: {exc}") from None
    if policy.ignored:
        log.warning("--router-policy-config: kvctl routes aggregated workers with the default cost function "
                    "and ignores %s", ", ".join(policy.ignored))
    if policy.shared_cache_multiplier is not None:
        log.info("--router-policy-config: shared_cache_multiplier has no effect (kvctl indexes no shared cache)")
    return policy


def fleet_options(options: FleetOptions, track_prefill_tokens: bool | None, policy: PolicyConfig | None,
                  path: Path | None) -> FleetOptions:
    """The options with the policy file's `router:` section over them, as Dynamo puts the section over its flags.

    UsageError (exit 2) naming the setting: where the settings do not go together (Dynamo's words), or where
    kvctl cannot route as the frontend would. A setting that changes none of kvctl's decisions is a warning."""
    if policy is None or not policy.router:
        return options
    from kvctl.core.router.router_section import combination_error, inert, kvctl_refusal, shown

    merged = {**options.as_dynamo(track_prefill_tokens), **policy.router}
    refusal = combination_error(merged) or kvctl_refusal(policy.router)
    if refusal is None and "router_ttl_secs" in policy.router and not merged["use_kv_events"] \
            and not merged["router_ttl_secs"] > 0:
        refusal = (f"router.router_ttl_secs: {shown(merged['router_ttl_secs'])} is not taken by kvctl serve: its "
                   "approximate mode needs a TTL > 0 (a block expiring as it is routed)")
    if refusal is not None:
        raise UsageError(f"--router-policy-config {path}: {refusal}")
    for line in inert(policy.router):
        log.warning("--router-policy-config: %s", line)
    log.info("--router-policy-config: router settings applied over the flags: %s",
             ", ".join(f"{key}={shown(value)}" for key, value in policy.router.items()))
    return options.with_settings(policy.router)


def router_config(flags: dict[str, float | bool | None], overlap_score_weight: float | None,
                  tier_credits: str | None, policy: Path | PolicyConfig | None,
                  queue: RouterQueue | None) -> tuple[RouterConfig, QueueProfiles | None]:
    """The router's knobs: Dynamo's defaults, then the flags, then the policy file's `router:` section, then its
    aggregated instance; and the router queue's policy classes: the file's profiles, else the flags' one class
    (`queue`), else none. `policy`: the file (read here), or as `read_policy` read it.

    The file wins over the flags as in Dynamo (its settings and parameters resolve over KvRouterConfig). UsageError
    (exit 2) on a bad value or a file Dynamo would refuse, with its reason on one line."""
    from kvctl.core.router.policy_classes import QueueProfiles, synthetic
    from kvctl.core.router.scoring import RouterConfig

    knobs = dict(flags)
    if tier_credits is not None:
        for knob, weight in parse_tier_credits(tier_credits).items():
            knobs[knob] = weight if knobs.get(knob) is None else knobs[knob]
    try:
        config = RouterConfig().override(overlap_score_weight=overlap_score_weight, **knobs)
    except ValueError as exc:
        raise UsageError(f"--{str(exc).replace('_', '-')}") from None
    if isinstance(policy, Path):
        policy = read_policy(policy)
    if policy is None:
        return config, None if queue is None else QueueProfiles(synthetic(queue))
    queues = QueueProfiles(synthetic(queue), policy.root, policy.models)
    return policy.apply(config), queues if queue is not None or queues.from_file else None
