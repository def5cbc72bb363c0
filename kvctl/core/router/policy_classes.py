"""Dynamo 1.6.1's router policy classes (`--router-policy-config`'s root profile and per-model `models` profiles):
which class a request falls in, and the class's own queue thresholds and order (docs/contract.md).

A profile names a default policy family, buckets of uncached prompt tokens and the classes: one per (family,
bucket), and explicit classes a request asks for by name. A request goes to the class it names if explicit, else
to its family's (the one it names, or the default) class for the bucket its uncached tokens fall in (`min_tokens`
inclusive). A model's own profile wins over the root's; with neither, the deprecated flags make one class,
`default`. Validated as Dynamo validates it, with its messages. Pure: the caller parses the YAML.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvctl.core.router.queue import QueuePolicy, RouterQueue

PROFILE_KEYS = ("default_policy_family", "uncached_isl_buckets", "policy_classes")
CLASS_FIELDS = ("name", "policy_family", "cache_bucket", "queue_policy", "quantum", "prefill_busy_threshold",
                "prefill_busy_threshold_frac", "request_queue_limit_per_worker",
                "raw_isl_token_queue_limit_per_worker", "cached_token_queue_limit_per_worker")
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_U64 = (1 << 64) - 1


class ProfileError(ValueError):
    """A profile Dynamo would refuse to start with; the message is Dynamo's, one line."""


@dataclass(frozen=True, slots=True)
class PolicyClass:
    """One class: its queue's order and the thresholds past which it holds a request (either is enough; none: it
    never holds one). The per-worker queue limits reject rather than hold; kvctl, holding no queue, shows them."""

    name: str
    queue_policy: QueuePolicy = QueuePolicy.fcfs
    quantum: int = 1
    prefill_busy_threshold: int | None = None  # tokens
    prefill_busy_threshold_frac: float | None = None  # of a rank's max_num_batched_tokens
    family: str | None = None
    bucket: str | None = None
    limits: tuple[int | None, int | None, int | None] = (None, None, None)  # requests, raw ISL, cached tokens

    @property
    def queues(self) -> bool:
        return self.prefill_busy_threshold is not None or self.prefill_busy_threshold_frac is not None


@dataclass(frozen=True, slots=True)
class Profile:
    default_family: str
    buckets: tuple[tuple[int, str], ...]  # (min uncached tokens, bucket), increasing from 0
    classes: tuple[PolicyClass, ...]

    def classify(self, uncached_tokens: int, requested: str | None = None) -> PolicyClass:
        """The class of a request with `uncached_tokens` (its prompt less the most any eligible rank holds)."""
        for c in self.classes:
            if requested and c.family is None and c.name == requested:
                return c
        families = {c.family for c in self.classes if c.family is not None}
        family = requested if requested in families else self.default_family
        bucket = [b for low, b in self.buckets if low <= uncached_tokens][-1]
        return next(c for c in self.classes if c.family == family and c.bucket == bucket)


def synthetic(queue: RouterQueue | None) -> Profile:
    """The deprecated flags' one class, `default`: queueing only with --router-queue-threshold."""
    only = PolicyClass("default", QueuePolicy.fcfs if queue is None else queue.policy, 1, None,
                       None if queue is None else queue.threshold, "default", "all")
    return Profile("default", ((0, "all"),), (only,))


@dataclass(frozen=True, slots=True)
class QueueProfiles:
    """A router's profiles: per model, the root's, else the flags' (`flags`)."""

    flags: Profile
    root: Profile | None = None
    models: Mapping[str, Profile] | None = None

    def profile(self, model: str) -> Profile:
        return (self.models or {}).get(model) or self.root or self.flags

    @property
    def from_file(self) -> bool:
        return self.root is not None or bool(self.models)

    def status(self) -> dict[str, Any]:
        """`/v1/status` `modes.queue`: the flags' threshold and policy (ignored where a profile applies, as in
        Dynamo), and each profile's classes."""
        flags = self.flags.classes[0]
        out: dict[str, Any] = {"threshold": flags.prefill_busy_threshold_frac, "policy": flags.queue_policy.value}
        if self.from_file:
            named = {**({"root": self.root} if self.root else {}),
                     **{f"model {m}": p for m, p in (self.models or {}).items()}}
            out["profiles"] = {name: [c.name for c in p.classes] for name, p in named.items()}
        return out


def parse_profiles(top: Mapping[str, Any]) -> tuple[Profile | None, dict[str, Profile]]:
    """The root profile and the `models` profiles of a policy file's top level (YAML already read)."""
    present = [key for key in PROFILE_KEYS if top.get(key) is not None]
    root = None
    if present:
        if len(present) < len(PROFILE_KEYS):
            raise ProfileError("invalid router policy config: root profile must specify default_policy_family, "
                               "uncached_isl_buckets, and policy_classes when any root profile field is present")
        root = _profile(top, "root", "")
    models: dict[str, Profile] = {}
    raw = top.get("models") or {}
    if not isinstance(raw, dict):
        raise ProfileError("failed to parse router policy config: models: invalid type: expected a map")
    for name, value in raw.items():
        where = f"models.{name}: "
        if not isinstance(value, dict):
            raise ProfileError(f"failed to parse router policy config: {where}invalid type: expected struct "
                               "RawPolicyProfile")
        _known(value, PROFILE_KEYS, where)
        for key in PROFILE_KEYS:
            if key not in value:
                raise ProfileError(f"failed to parse router policy config: {where}missing field `{key}`")
        if str(name) == "":
            raise ProfileError("invalid router policy config: model profile name must not be empty")
        models[str(name)] = _profile(value, f'model "{name}"', f"models.{name}.")
    return root, models


def _known(value: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    for key in value:
        if key not in allowed:
            raise ProfileError(f"failed to parse router policy config: {where}unknown field `{key}`, expected one "
                               f"of {', '.join(f'`{k}`' for k in allowed)}")


def _invalid(message: str) -> ProfileError:
    return ProfileError(f"invalid router policy config: {message}")


def _profile(raw: Mapping[str, Any], loc: str, path: str) -> Profile:
    family = raw["default_policy_family"]
    if not isinstance(family, str) or not _NAME.fullmatch(family):
        raise _invalid(f'{loc} policy family name "{family}" must match [A-Za-z0-9_.-]+')
    items = raw["policy_classes"]
    if not isinstance(items, list) or not items:
        raise _invalid(f"{loc} policy_classes must not be empty")
    buckets = _buckets(raw["uncached_isl_buckets"], loc, path)
    classes: list[PolicyClass] = []
    for i, item in enumerate(items):
        c = _class(item, loc, f"{path}policy_classes[{i}]: ", {b for _, b in buckets})
        if any(other.name == c.name for other in classes):
            raise _invalid(f'{loc} contains duplicate policy class "{c.name}"')
        classes.append(c)
    families = {c.family for c in classes if c.family is not None}
    if family not in families:
        raise _invalid(f'{loc} default_policy_family "{family}" does not name a configured family')
    for c in classes:
        if c.family is None and c.name in families:
            raise _invalid(f'{loc} explicit policy class "{c.name}" collides with a policy family')
    seen: set[tuple[str, str]] = set()
    for c in classes:
        if c.family is not None and c.bucket is not None:
            if (c.family, c.bucket) in seen:
                raise _invalid(f'{loc} contains duplicate policy classes for family "{c.family}" and bucket '
                               f'"{c.bucket}"')
            seen.add((c.family, c.bucket))
    for f in sorted(families):
        for _, b in buckets:
            if (f, b) not in seen:
                raise _invalid(f'{loc} is missing a policy class for family "{f}" and bucket "{b}"')
    return Profile(family, tuple(buckets), tuple(classes))


def _buckets(raw: Any, loc: str, path: str) -> list[tuple[int, str]]:
    if not isinstance(raw, list) or not raw:
        raise _invalid(f"{loc} uncached_isl_buckets must not be empty")
    out: list[tuple[int, str]] = []
    for i, item in enumerate(raw):
        where = f"{path}uncached_isl_buckets[{i}]: "
        if not isinstance(item, dict):
            raise ProfileError(f"failed to parse router policy config: {where}invalid type: expected struct "
                               "RawUncachedIslBucket")
        _known(item, ("min_tokens", "bucket"), where)
        for key in ("min_tokens", "bucket"):
            if key not in item:
                raise ProfileError(f"failed to parse router policy config: {where}missing field `{key}`")
        out.append((_usize(item["min_tokens"], where), item["bucket"]))
    if out[0][0] != 0:
        raise _invalid(f"{loc} uncached_isl_buckets must start at min_tokens 0")
    if any(b[0] <= a[0] for a, b in zip(out, out[1:], strict=False)):
        raise _invalid(f"{loc} uncached_isl_buckets min_tokens must be strictly increasing")
    for _, name in out:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _invalid(f'{loc} cache bucket name "{name}" must match [A-Za-z0-9_.-]+')
    names = [name for _, name in out]
    for name in names:
        if names.count(name) > 1:
            raise _invalid(f'{loc} contains duplicate cache bucket "{name}"')
    return out


def _usize(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _U64:
        raise ProfileError(f"failed to parse router policy config: {where}invalid type: `{value}`, expected usize")
    return int(value)


def _class(raw: Any, loc: str, where: str, buckets: set[str]) -> PolicyClass:
    if not isinstance(raw, dict):
        raise ProfileError(f"failed to parse router policy config: {where}invalid type: expected struct "
                           "RawPolicyClass")
    _known(raw, CLASS_FIELDS, where)
    for key in ("name", "quantum"):
        if key not in raw:
            raise ProfileError(f"failed to parse router policy config: {where}missing field `{key}`")
    policy = raw.get("queue_policy", "fcfs")
    if policy not in ("fcfs", "wspt", "lcfs"):
        raise ProfileError(f"failed to parse router policy config: {where}unknown variant `{policy}`, expected "
                           "one of `fcfs`, `lcfs`, `wspt`")
    quantum = _usize(raw["quantum"], where)
    absolute = None if raw.get("prefill_busy_threshold") is None else _usize(raw["prefill_busy_threshold"], where)
    limits = tuple(None if raw.get(k) is None else _usize(raw[k], where) for k in CLASS_FIELDS[7:])
    frac = raw.get("prefill_busy_threshold_frac")
    if frac is not None and (isinstance(frac, bool) or not isinstance(frac, int | float)):
        raise ProfileError(f"failed to parse router policy config: {where}invalid type: `{frac}`, expected f64")
    name = raw["name"]
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _invalid(f'{loc} policy class name "{name}" must match [A-Za-z0-9_.-]+')
    if quantum == 0:
        raise _invalid(f'{loc} policy class "{name}" quantum must be greater than zero')
    if policy == "lcfs":
        raise _invalid(f'{loc} policy class "{name}" queue_policy must be fcfs or wspt')
    if frac is not None and not (math.isfinite(frac) and frac >= 0):
        raise _invalid(f'{loc} policy class "{name}" prefill_busy_threshold_frac must be finite and non-negative')
    family, bucket = raw.get("policy_family"), raw.get("cache_bucket")
    if (family is None) != (bucket is None):
        raise _invalid(f'{loc} policy class "{name}" must specify both policy_family and cache_bucket or neither '
                       "for an explicit class")
    if family is not None and (not isinstance(family, str) or not _NAME.fullmatch(family)):
        raise _invalid(f'{loc} policy family name "{family}" must match [A-Za-z0-9_.-]+')
    if bucket is not None and bucket not in buckets:
        raise _invalid(f'{loc} policy class "{name}" references unknown cache bucket "{bucket}"')
    return PolicyClass(name, QueuePolicy(policy), quantum, absolute, None if frac is None else float(frac), family,
                       bucket, (limits[0], limits[1], limits[2]))
