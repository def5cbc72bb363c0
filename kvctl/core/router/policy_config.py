"""Dynamo's `--router-policy-config` YAML, read as Dynamo 1.6.1 reads it, for the knobs kvctl's router has.

The file (docs/contract.md) names worker-selection policy instances and which one each worker pool uses:

    router:                                 # router-wide settings (router_section.py)
      host_cache_hit_weight: 0.5
      router_track_prefill_tokens: false
    worker_selection:
      aggregated: mine                      # or prefill / decode / encode; "default": the built-in selector
      instances:
        - name: mine
          type: dynamo-default-cost-fn
          parameters: {overlap_score_credit: 0.5, router_temperature: 0.1, ...}

The `router:` section is checked first, as the frontend's Python checks it before the rest (router_section.py
says how, and what kvctl makes of each setting); its settings win over the flags. kvctl routes aggregated
workers, so it takes the `aggregated` instance's parameters, which win over both (as Dynamo's
`Parameters::resolve` does). The root and per-model profiles' policy classes are the router queue's
(policy_classes.py). What Dynamo rejects is rejected with its words: unknown keys, bad names, duplicate or
missing instances, a parameter that is not a finite number >= 0, an unknown policy type. Like Dynamo, only the
instance in use has its type and parameters checked. kvctl implements one policy type, Dynamo's default cost
function; the other types Dynamo links are refused by name. The sections kvctl has no use for (request
classifiers, other pools' selections) are accepted and reported in `ignored`. Scalars are resolved as YAML 1.2
(Dynamo's serde_yaml) does: `yes` is a string, `1e3` a float; the `router:` section is also read as YAML 1.1, as
Dynamo's Python reads it. Pure: the caller reads the file.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

import yaml

from kvctl.core.router.policy_classes import Profile, ProfileError, parse_profiles
from kvctl.core.router.router_section import RouterSectionError, knobs, parse_router_section
from kvctl.core.router.scoring import KNOBS, RouterConfig

TOP_LEVEL = ("router", "default_policy_family", "policy_classes", "uncached_isl_buckets", "models",
             "worker_selection", "request_classifier")
STAGES = ("aggregated", "prefill", "decode", "encode")
DEFAULT_COST_FN = "dynamo-default-cost-fn"
DYNAMO_POLICY_TYPES = (DEFAULT_COST_FN, "dynamo-two-tier-cost-fn", "thunderagent")
"""The worker-selection policy types Dynamo 1.6.1 links (its error message lists them)."""
PARAMETERS = (*KNOBS[:-1], "shared_cache_multiplier")
"""The default cost function's parameters: the knobs but prefill-token tracking, plus the shared-cache weight."""

_IDENTIFIER = re.compile(r"[A-Za-z0-9_.-]+")


class PolicyConfigError(ValueError):
    """The file is not one Dynamo would start with; the message is one line."""


@dataclass(frozen=True)
class PolicyConfig:
    knobs: dict[str, float]
    """The aggregated instance's parameters that kvctl's router has (by Dynamo name); empty: the flags'."""
    shared_cache_multiplier: float | None
    """Validated like the others; kvctl indexes no shared cache (Dynamo's HiCache), so it changes nothing."""
    instance: str | None
    ignored: list[str]
    """Sections and stage selections kvctl reads but has no use for."""
    root: Profile | None = None
    """The root profile's policy classes (the router queue's, for every model without a profile of its own)."""
    models: dict[str, Profile] = dataclasses.field(default_factory=dict)
    router: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The `router:` section's settings by Dynamo name, checked as Dynamo checks them (router_section.py); they
    win over the flags. Its cost-function settings are applied by `apply`; `serve` maps the others."""

    def router_wide(self, flags: RouterConfig) -> RouterConfig:
        """`flags` with the `router:` section's cost-function settings over them: the router-wide config."""
        return flags.override(**knobs(self.router)) if self.router else flags

    def apply(self, config: RouterConfig) -> RouterConfig:
        """`config` (the flags') with the `router:` section's settings, then the instance's parameters, over it,
        as Dynamo resolves them.

        Dynamo scores with the instance's tier weights but books a reservation's prefill with the
        router-wide ones (the section's, else the flags'), so those are kept for booking."""
        config = self.router_wide(config)
        if not self.knobs:
            return config
        booked = config.booked_tier_weights or (config.host_cache_hit_weight, config.disk_cache_hit_weight)
        return dataclasses.replace(config.override(**self.knobs), booked_tier_weights=booked)


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 core-schema booleans and floats, as serde_yaml resolves them."""


_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in ("tag:yaml.org,2002:bool",
                                                                       "tag:yaml.org,2002:int",
                                                                       "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                    list("tTfF"))
_Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
                                    list("-+0123456789"))  # before floats: `5` is an int
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))


def _float_1_2(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float | str:
    text = str(loader.construct_scalar(node))
    special = text.lower().lstrip("+-")
    if special in (".inf", ".nan"):
        return float(text.lower().replace(".", "", 1))  # "-.inf" -> "-inf", ".nan" -> "nan"
    value = float(text)
    return text if math.isinf(value) else value  # serde_yaml keeps a float it cannot hold as a string


def _int_1_2(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    """YAML 1.2's ints: no `1_000`, no `1:30`, no leading-zero octal (YAML 1.1's, which PyYAML reads)."""
    text = str(loader.construct_scalar(node))
    return int(text[2:], {"0o": 8, "0x": 16}[text[:2]]) if text[:2] in ("0o", "0x") else int(text, 10)


_Yaml12Loader.add_constructor("tag:yaml.org,2002:float", _float_1_2)
_Yaml12Loader.add_constructor("tag:yaml.org,2002:int", _int_1_2)


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, str):
        return f'string "{value}"'
    if isinstance(value, list):
        return "sequence"
    if isinstance(value, dict):
        return "map"
    return f"`{value}`"


def _fields(where: str, value: Any, allowed: tuple[str, ...], what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise PolicyConfigError(f"{where}invalid type: {_type_name(value)}, expected {what}")
    for key in value:
        if key not in allowed:
            expected = ", ".join(f"`{k}`" for k in allowed)
            raise PolicyConfigError(f"{where}unknown field `{key}`, expected one of {expected}")
    return value


def _identifier(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _IDENTIFIER.fullmatch(value):
        shown = f'"{value}"' if isinstance(value, str) else _type_name(value)
        raise PolicyConfigError(f"invalid router policy config: worker_selection {what} {shown} must match "
                                f"[A-Za-z0-9_.-]+")
    return value


def parse_policy_config(text: str) -> PolicyConfig:
    """The router knobs a policy file sets for aggregated workers; PolicyConfigError as Dynamo would refuse it."""
    try:
        data = yaml.load(text, Loader=_Yaml12Loader)  # noqa: S506 - a safe loader, with YAML 1.2 scalars
        loose = yaml.safe_load(text)  # YAML 1.1, as Dynamo's Python reads the router section first
    except (yaml.YAMLError, ValueError) as exc:  # ValueError: a timestamp-like scalar that is no date
        raise PolicyConfigError(f"failed to parse router policy config: {' '.join(str(exc).split())}") from None
    router = _router_section(loose, data)
    top = _fields("failed to parse router policy config: ", {} if data is None else data, TOP_LEVEL,
                  "struct RawRouterPolicyConfig")
    if not any(top.get(key) is not None for key in TOP_LEVEL):
        raise PolicyConfigError("invalid router policy config: router policy config must define router settings, "
                                "a root profile, at least one model profile, worker_selection, or request_classifier")
    try:
        root, models = parse_profiles(top)
    except ProfileError as exc:
        raise PolicyConfigError(str(exc)) from None
    ignored = ["request_classifier"] if top.get("request_classifier") is not None else []
    raw = top.get("worker_selection")
    if raw is None:
        return PolicyConfig({}, None, None, ignored, root, models, router)
    selection = _fields("failed to parse router policy config: worker_selection: ", raw, (*STAGES, "instances"),
                        "struct RawWorkerSelectionConfig")
    if not any(selection.get(key) for key in (*STAGES, "instances")):
        raise PolicyConfigError("invalid router policy config: worker_selection must define an instance or an "
                                "aggregated, prefill, decode, or encode selection")
    instances: dict[str, tuple[str, dict[str, Any]]] = {}
    for i, item in enumerate(selection.get("instances") or []):
        where = f"failed to parse router policy config: worker_selection.instances[{i}]: "
        fields = _fields(where, item, ("name", "type", "parameters"), "struct RawWorkerSelectionInstance")
        for required in ("name", "type"):
            if required not in fields:
                raise PolicyConfigError(f"{where}missing field `{required}`")
        name = _identifier(fields["name"], "instance name")
        if name == "default":
            raise PolicyConfigError("invalid router policy config: worker_selection instance name 'default' is "
                                    "reserved for Dynamo's built-in selector")
        policy_type = _identifier(fields["type"], "policy type")
        parameters = fields.get("parameters", {})
        if not isinstance(parameters, dict):
            raise PolicyConfigError(f'invalid router policy config: worker_selection instance "{name}" parameters '
                                    f"must be a YAML mapping")
        if name in instances:
            raise PolicyConfigError(f'invalid router policy config: worker_selection contains duplicate instance '
                                    f'"{name}"')
        instances[name] = (policy_type, parameters)
    for stage in STAGES:
        chosen = selection.get(stage)
        if chosen is not None and chosen != "default" and chosen not in instances:
            raise PolicyConfigError(f'invalid router policy config: worker_selection {stage} "{chosen}" does not '
                                    f"name a configured instance")
    ignored += [f"worker_selection.{stage}" for stage in STAGES[1:] if selection.get(stage) is not None]
    chosen = selection.get("aggregated")
    if chosen is None or chosen == "default":
        return PolicyConfig({}, None, None, ignored, root, models, router)
    policy_type, parameters = instances[chosen]
    instance = _parameters(policy_type, parameters)
    shared = instance.pop("shared_cache_multiplier", None)
    return PolicyConfig(instance, shared, chosen, ignored, root, models, router)


def _router_section(loose: Any, strict: Any) -> dict[str, Any]:
    """The `router:` section, checked before the rest of the file as the frontend's Python checks it first."""
    if not isinstance(loose, dict) or loose.get("router") is None:
        return {}
    try:
        return parse_router_section(loose["router"], strict.get("router") if isinstance(strict, dict) else None)
    except RouterSectionError as exc:
        raise PolicyConfigError(str(exc)) from None


def _parameters(policy_type: str, parameters: dict[str, Any]) -> dict[str, float]:
    if policy_type not in DYNAMO_POLICY_TYPES:
        raise PolicyConfigError(f'unknown worker-selection policy type "{policy_type}"; linked policy types: '
                                f"{', '.join(DYNAMO_POLICY_TYPES)}")
    if policy_type != DEFAULT_COST_FN:
        raise PolicyConfigError(f'worker-selection policy type "{policy_type}" is Dynamo\'s but kvctl implements '
                                f"only {DEFAULT_COST_FN}")
    where = f'invalid parameters for worker-selection policy type "{policy_type}": '
    _fields(where, parameters, PARAMETERS, "struct Parameters")
    knobs = {}
    for name in PARAMETERS:  # checked in Dynamo's order: the first bad one is named
        value = parameters.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise PolicyConfigError(f"{where}invalid type: {_type_name(value)}, expected f64")
        if not math.isfinite(value) or value < 0:
            raise PolicyConfigError(f"{where}{name} must be finite and non-negative")
        knobs[name] = float(value)
    return knobs
