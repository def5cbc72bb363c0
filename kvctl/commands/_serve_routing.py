"""How `kvctl serve`'s routing flags become the router's config: the cost function's knobs, the deprecated
--tier-credits, and Dynamo's --router-policy-config, in Dynamo's order of precedence."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from kvctl.errors import UsageError

if TYPE_CHECKING:
    from kvctl.core.router.policy_classes import QueueProfiles
    from kvctl.core.router.queue import RouterQueue
    from kvctl.core.router.scoring import RouterConfig
    from kvctl.core.tracking_hash import TrackingKey


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


def router_config(flags: dict[str, float | bool | None], overlap_score_weight: float | None,
                  tier_credits: str | None, policy_file: Path | None,
                  queue: RouterQueue | None) -> tuple[RouterConfig, QueueProfiles | None]:
    """The router's knobs: Dynamo's defaults, then the flags, then the policy file's aggregated instance; and the
    router queue's policy classes: the file's profiles, else the flags' one class (`queue`), else none.

    The file wins over the flags as in Dynamo (its parameters resolve over KvRouterConfig). UsageError
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
    if policy_file is None:
        return config, None if queue is None else QueueProfiles(synthetic(queue))
    import logging

    from kvctl.core.router.policy_config import PolicyConfigError, parse_policy_config  # YAML: loaded if asked

    try:
        policy = parse_policy_config(policy_file.read_text())
    except OSError as exc:
        raise UsageError(f"--router-policy-config: failed to read router policy config {policy_file}: "
                         f"{exc.strerror}") from None
    except (PolicyConfigError, UnicodeDecodeError) as exc:
        raise UsageError(f"--router-policy-config {policy_file}: {exc}") from None
    log = logging.getLogger("kvctl.serve")
    if policy.ignored:
        log.warning("--router-policy-config: kvctl routes aggregated workers with the default cost function "
                    "and ignores %s", ", ".join(policy.ignored))
    if policy.shared_cache_multiplier is not None:
        log.info("--router-policy-config: shared_cache_multiplier has no effect (kvctl indexes no shared cache)")
    queues = QueueProfiles(synthetic(queue), policy.root, policy.models)
    return policy.apply(config), queues if queue is not None or queues.from_file else None
