"""KV tier hit rates from raw metric samples (docs/contract.md): each number with the family it came from.

Both sources arrive here as the same input, one `Window` per instance: a counter as its increase over
the window, a gauge as its last value. Prometheus computes the increase itself (`increase(m[w])`);
two scrapes of a `/metrics` endpoint go through `increases`, where a counter that went down was reset
(the engine restarted) and its increase is its new value, as Prometheus counts it. One scrape alone is a
window of unknown (infinite) length: counters since each engine started, whose ratios hold but whose
rates cannot be had, so a report of such windows (`Basis.since_start`) has none.

Names are matched by pattern, not looked up: counters come with or without `_total` (KVBM writes
none, prometheus_client's parser adds one), and some KVBM versions say `remote` where others say
`object`. A ratio of two counters keeps its parts, so totals over instances are Σ hits / Σ queries
rather than a mean of ratios; gauges (KVBM's sliding-window hit rates) have no parts and no total.

Pure: no I/O, no clock; the caller measures the window.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvctl.core.nagios import Perf, plugin_output

CHECK_TIERS = ("host", "disk", "object", "device")


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


@dataclass(frozen=True, slots=True)
class Window:
    """What one instance showed over `seconds`: counters as increases, gauges as their last value."""

    instance: str
    seconds: float
    samples: tuple[Sample, ...]


@dataclass(frozen=True, slots=True)
class Family:
    """A metric family as docs/contract.md names it, and the exposed sample names it matches.

    The variant of a sample (a tier, a transfer direction, sum or count) is the pattern's group,
    or else the value of the `split` label.
    """

    doc: str
    pattern: re.Pattern[str]
    counter: bool
    split: str | None = None

    def variant(self, name: str, labels: Mapping[str, str]) -> str | None:
        """The sample's variant when this family matches its name, else None."""
        match = self.pattern.fullmatch(name)
        if match is None:
            return None
        raw = match.group(1) if match.re.groups else labels.get(self.split or "", "")
        return _ALIASES.get(raw, raw)


def _family(doc: str, pattern: str, *, counter: bool, split: str | None = None) -> Family:
    suffix = r"(?:_total)?" if counter else ""
    return Family(doc, re.compile(pattern + suffix), counter, split)


_ALIASES = {"remote": "object", "d2r": "d2o", "r2d": "o2d", "external_unspecified": "external", "storage": "disk"}

KVBM_HIT = _family("kvbm_{host,disk,object}_cache_hit_rate", r"kvbm_(host|disk|object|remote)_cache_hit_rate",
                   counter=False)
KVBM_OFFLOAD = _family("kvbm_offload_blocks_{d2h,h2d,d2d,d2o}", r"kvbm_offload_blocks_(d2h|h2d|d2d|d2o|d2r)",
                       counter=True)
KVBM_ONBOARD = _family("kvbm_onboard_blocks_{h2d,d2d,o2d}", r"kvbm_onboard_blocks_(h2d|d2d|o2d|r2d)", counter=True)
KVBM_MATCHED = _family("kvbm_matched_tokens", r"kvbm_matched_tokens", counter=True)
KVBM_FAILURES = _family("kvbm_object_{read,write}_failures", r"kvbm_(?:object|remote)_(read|write)_failures",
                        counter=True)
VLLM_BY_SOURCE = _family("vllm:prompt_tokens_cached_by_source", r"vllm:prompt_tokens_cached_by_source",
                         counter=True, split="source")
VLLM_QUERIES = _family("vllm:prefix_cache_queries", r"vllm:prefix_cache_queries", counter=True)
VLLM_HITS = _family("vllm:prefix_cache_hits", r"vllm:prefix_cache_hits", counter=True)
VLLM_USAGE = _family("vllm:kv_cache_usage_perc", r"vllm:(?:kv|gpu)_cache_usage_perc", counter=False)
SGLANG_CACHED = _family("sglang:cached_tokens_total", r"sglang:cached_tokens", counter=True, split="cache_source")
SGLANG_HIT = _family("sglang:cache_hit_rate", r"sglang:cache_hit_rate", counter=False)
SGLANG_USAGE = _family("sglang:token_usage", r"sglang:token_usage", counter=False)
LMCACHE_HIT = _family("lmcache:num_hit_tokens", r"lmcache:num_hit_tokens", counter=True)
LMCACHE_REQUESTED = _family("lmcache:num_requested_tokens", r"lmcache:num_requested_tokens", counter=True)
LMCACHE_RATES = _family("lmcache:{retrieve,lookup}_hit_rate", r"lmcache:(retrieve|lookup)_hit_rate", counter=False)
KVCTL_PREDICTED = Family("kvctl_route_predicted_hit_rate", re.compile(r"kvctl_route_predicted_hit_rate_(sum|count)"),
                         counter=True)
# Dynamo 1.6.1. The router's predicted hit rate is a histogram (one observation per routed request): its mean
# over the window is increase(_sum) / increase(_count). The frontend's `cached_tokens` and `input_sequence_tokens`
# are histograms by model of what the engines reported per request (usage.prompt_tokens_details.cached_tokens)
# and of prompt lengths: the share of prompt tokens the engines found cached is Σ cached / Σ input.
DYNAMO_PREDICTED = Family("dynamo_component_router_kv_hit_rate",
                          re.compile(r"dynamo_component_router_kv_hit_rate_(sum|count)"), counter=True)
DYNAMO_CACHED = Family("dynamo_frontend_cached_tokens", re.compile(r"dynamo_frontend_cached_tokens_(sum|count)"),
                       counter=True)
DYNAMO_INPUT = Family("dynamo_frontend_input_sequence_tokens",
                      re.compile(r"dynamo_frontend_input_sequence_tokens_(sum|count)"), counter=True)
# A Dynamo backend worker's own gauges (dynamo.common.utils.prometheus.LLMBackendMetrics, per dp_rank); the
# mocker does not export them (it exports vLLM's `vllm:kv_cache_usage_perc` and `vllm:gpu_cache_usage_perc`).
DYNAMO_USAGE = _family("dynamo_component_gpu_cache_usage_percent", r"dynamo_component_gpu_cache_usage_percent",
                       counter=False)
DYNAMO_WORKER_HIT = _family("dynamo_component_kv_cache_hit_rate", r"dynamo_component_kv_cache_hit_rate",
                            counter=False)
# A Dynamo frontend's router queue (`--router-queue-threshold`): requests pending now, and refusals at its caps.
# Not tier metrics: doctor's frontend_queue check reads them from the same scrapes.
DYNAMO_QUEUE_PENDING = _family("dynamo_frontend_router_queue_pending_requests",
                               r"dynamo_frontend_router_queue_pending_requests", counter=False)
DYNAMO_QUEUE_REFUSED = _family("dynamo_frontend_router_queue_backpressure_total",
                               r"dynamo_frontend_router_queue_backpressure", counter=True)

# A Dynamo router's own account of its decisions (prompt tokens cached on the best eligible worker and on the one it
# picked): doctor's routing check sets them beside the decision audit's.
DYNAMO_DECISIONS = _family("dynamo_{component_router,frontend}_{kv_best_eligible_cached_prefix_tokens,"
                           "kv_selected_cached_prefix_tokens,non_max_overlap_selections}",
                           r"dynamo_(?:component_router|frontend)_(kv_best_eligible_cached_prefix_tokens|"
                           r"kv_selected_cached_prefix_tokens|non_max_overlap_selections)", counter=True)

FAMILIES = (KVBM_HIT, KVBM_OFFLOAD, KVBM_ONBOARD, KVBM_MATCHED, KVBM_FAILURES, VLLM_BY_SOURCE, VLLM_QUERIES,
            VLLM_HITS, VLLM_USAGE, SGLANG_CACHED, SGLANG_HIT, SGLANG_USAGE, LMCACHE_HIT, LMCACHE_REQUESTED,
            LMCACHE_RATES, KVCTL_PREDICTED, DYNAMO_PREDICTED, DYNAMO_CACHED, DYNAMO_INPUT, DYNAMO_USAGE,
            DYNAMO_WORKER_HIT)
READ = (*FAMILIES, DYNAMO_QUEUE_PENDING, DYNAMO_QUEUE_REFUSED, DYNAMO_DECISIONS)
"""Every family a scrape keeps: the tier report's, and what doctor reads beside them."""

LOWER_TIERS = ("host", "disk", "object", "p2p", "external")
"""The tiers below the device's own memory: an instance exports tier counters when it reports any of them."""

# KVBM names a transfer by its direction; the tier it concerns is where an offload goes, where an onboard comes from.
_OFFLOAD_TIER = {"d2h": "host", "h2d": "disk", "d2d": "disk", "d2o": "object"}
_ONBOARD_TIER = {"h2d": "host", "d2d": "disk", "o2d": "object"}


def family_of(name: str, labels: Mapping[str, str] | None = None) -> tuple[Family, str] | None:
    """The family a sample name belongs to, with the sample's variant; None for names kvctl does not read."""
    for family in READ:
        variant = family.variant(name, labels or {})
        if variant is not None:
            return family, variant
    return None


def counter_increase(before: float, after: float) -> float:
    """A counter's increase between two readings; a decrease means a reset, after which it counted from 0."""
    return after - before if after >= before else after


def increases(before: Iterable[Sample], after: Iterable[Sample]) -> tuple[Sample, ...]:
    """Two scrapes of one endpoint as a window's samples: counters' increases, gauges' later values.

    A series missing from the first scrape started within the window, so it counted from 0.
    """
    prior = {(s.name, frozenset(s.labels.items())): s.value for s in before}
    out = []
    for sample in after:
        found = family_of(sample.name, sample.labels)
        if found is None:
            continue
        value = sample.value
        if found[0].counter:
            value = counter_increase(prior.get((sample.name, frozenset(sample.labels.items())), 0.0), value)
        out.append(Sample(sample.name, sample.labels, value))
    return tuple(out)


class Basis(StrEnum):
    """What a report's counters were counted over."""

    window = "window"  # their increase over a measured window
    since_start = "since_start"  # their values: since each engine (re)started, a window of unknown length


class Kind(StrEnum):
    ratio = "ratio"  # in [0, 1]
    rate = "rate"  # per second
    # The member shadows str.count, as StrEnum's members do what they are named after: "count" is the word.
    count = "count"  # type: ignore[assignment]  # over the window


@dataclass(frozen=True, slots=True)
class Reading:
    """One number of the report. `parts` are the (numerator, denominator) increases of a counter ratio."""

    instance: str
    tier: str | None
    metric: str
    value: float | None
    family: str
    kind: Kind
    parts: tuple[float, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        numerator, denominator = self.parts or (None, None)
        return {"instance": self.instance, "tier": self.tier, "metric": self.metric, "value": self.value,
                "kind": self.kind.value, "family": self.family, "numerator": numerator, "denominator": denominator}


def ratio(numerator: float, denominator: float) -> float | None:
    """`numerator / denominator` clamped to [0, 1] (two counters reset at different moments can overshoot);
    None when nothing was counted."""
    if denominator <= 0:
        return None
    return min(1.0, max(0.0, numerator / denominator))


@dataclass
class _Instance:
    """One window's samples summed per (family, variant): counters add up, gauges average (DP engines)."""

    name: str
    seconds: float
    values: dict[tuple[str, str], float] = field(default_factory=dict)

    @classmethod
    def of(cls, window: Window) -> _Instance:
        seen: dict[tuple[str, str], list[float]] = defaultdict(list)
        counters = set()
        for sample in window.samples:
            found = family_of(sample.name, sample.labels)
            if found is not None:
                seen[found[0].doc, found[1]].append(sample.value)
                if found[0].counter:
                    counters.add((found[0].doc, found[1]))
        values = {key: sum(vs) if key in counters else sum(vs) / len(vs) for key, vs in seen.items()}
        return cls(window.instance, window.seconds, values)

    def get(self, family: Family, variant: str = "") -> float | None:
        return self.values.get((family.doc, variant))

    def variants(self, family: Family) -> dict[str, float]:
        return {variant: value for (doc, variant), value in self.values.items() if doc == family.doc}

    def reading(self, tier: str | None, metric: str, value: float | None, family: str, kind: Kind,
                parts: tuple[float, float] | None = None) -> Reading:
        return Reading(self.name, tier, metric, value, family, kind, parts)

    def ratio(self, tier: str | None, metric: str, numerator: float, denominator: float, family: str) -> Reading:
        return self.reading(tier, metric, ratio(numerator, denominator), family, Kind.ratio, (numerator, denominator))

    def gauges(self, family: Family, metric: str, *, tier: str | None = None) -> Iterator[Reading]:
        """One reading per variant of a gauge family; the variant names the tier unless `tier` is given."""
        for variant, value in sorted(self.variants(family).items()):
            name = _name(family.doc, variant)
            yield self.reading(tier or variant, metric.format(variant), value, name, Kind.ratio)

    def rate(self, tier: str | None, metric: str, increase: float, family: str) -> Iterator[Reading]:
        """`increase` per second of the window; nothing when the window's length is unknown."""
        if math.isfinite(self.seconds):
            yield self.reading(tier, metric, increase / self.seconds, family, Kind.rate)

    def shares(self, family: Family) -> Iterator[Reading]:
        """Cached tokens per source as shares of all cached tokens (summing to 1) and as tokens per second."""
        by_tier = self.variants(family)
        whole = sum(by_tier.values())
        for tier, tokens in sorted(by_tier.items()):
            yield self.ratio(tier, "share", tokens, whole, family.doc)
            yield from self.rate(tier, "cached_tokens_per_s", tokens, family.doc)


def _name(doc: str, variant: str) -> str:
    """`kvbm_{host,disk,object}_cache_hit_rate` with variant `host` -> `kvbm_host_cache_hit_rate`."""
    return re.sub(r"\{[^}]*\}", variant, doc, count=1)


def _kvbm(inst: _Instance) -> Iterator[Reading]:
    yield from inst.gauges(KVBM_HIT, "hit_rate")
    for family, tiers, metric in ((KVBM_OFFLOAD, _OFFLOAD_TIER, "offload_blocks_per_s"),
                                  (KVBM_ONBOARD, _ONBOARD_TIER, "onboard_blocks_per_s")):
        by_tier: dict[str, dict[str, float]] = defaultdict(dict)
        for direction, blocks in inst.variants(family).items():
            by_tier[tiers[direction]][direction] = blocks
        for tier, directions in sorted(by_tier.items()):
            names = "+".join(_name(family.doc, d) for d in sorted(directions))
            yield from inst.rate(tier, metric, sum(directions.values()), names)
    matched = inst.get(KVBM_MATCHED)
    if matched is not None:
        yield from inst.rate(None, "matched_tokens_per_s", matched, KVBM_MATCHED.doc)
    for op, failures in sorted(inst.variants(KVBM_FAILURES).items()):
        yield inst.reading("object", f"{op}_failures", failures, _name(KVBM_FAILURES.doc, op), Kind.count)


def _vllm(inst: _Instance) -> Iterator[Reading]:
    queries, hits = inst.get(VLLM_QUERIES), inst.get(VLLM_HITS)
    if queries is not None and hits is not None:
        yield inst.ratio("device", "hit_rate", hits, queries, f"{VLLM_HITS.doc} / {VLLM_QUERIES.doc}")
    if queries is not None:
        for tier, tokens in sorted(inst.variants(VLLM_BY_SOURCE).items()):
            if tier != "device":  # the device's own hit rate is the prefix cache's, above
                yield inst.ratio(tier, "hit_rate", tokens, queries, f"{VLLM_BY_SOURCE.doc} / {VLLM_QUERIES.doc}")
    yield from inst.shares(VLLM_BY_SOURCE)
    yield from inst.gauges(VLLM_USAGE, "usage", tier="device")


def _sglang(inst: _Instance) -> Iterator[Reading]:
    yield from inst.gauges(SGLANG_HIT, "hit_rate", tier="device")
    yield from inst.shares(SGLANG_CACHED)
    yield from inst.gauges(SGLANG_USAGE, "usage", tier="device")


def _lmcache(inst: _Instance) -> Iterator[Reading]:
    hit, requested = inst.get(LMCACHE_HIT), inst.get(LMCACHE_REQUESTED)
    if hit is not None and requested is not None:
        yield inst.ratio("external", "hit_rate", hit, requested, f"{LMCACHE_HIT.doc} / {LMCACHE_REQUESTED.doc}")
    yield from inst.gauges(LMCACHE_RATES, "{}_hit_rate", tier="external")


def _router(inst: _Instance) -> Iterator[Reading]:
    """A router's predicted hit rate: the mean of its histogram over the window, Σ increase(sum) / increase(count)."""
    for family in (KVCTL_PREDICTED, DYNAMO_PREDICTED):
        total, count = inst.get(family, "sum"), inst.get(family, "count")
        if total is not None and count is not None:
            yield inst.ratio(None, "predicted_hit_rate", total, count, f"{family.doc} (mean)")


def _dynamo(inst: _Instance) -> Iterator[Reading]:
    """A Dynamo frontend's share of prompt tokens its engines reported cached (any tier the engine counts: the
    frontend does not say which), and a Dynamo worker's own KV gauges."""
    cached, requests = inst.get(DYNAMO_CACHED, "sum"), inst.get(DYNAMO_CACHED, "count")
    prompt, prompts = inst.get(DYNAMO_INPUT, "sum"), inst.get(DYNAMO_INPUT, "count")
    if cached is not None and requests is not None and prompt is not None and prompts is not None \
            and not (prompts > 0 and requests == 0):  # requests but no cached-token report: unknown, not 0 %
        yield inst.ratio(None, "cached_share", cached, prompt, f"{DYNAMO_CACHED.doc} / {DYNAMO_INPUT.doc} (sums)")
    yield from inst.gauges(DYNAMO_WORKER_HIT, "hit_rate", tier="device")
    yield from inst.gauges(DYNAMO_USAGE, "usage", tier="device")


_DERIVATIONS = (_kvbm, _vllm, _sglang, _lmcache, _router, _dynamo)


@dataclass(frozen=True)
class TierReport:
    instances: tuple[tuple[str, float], ...]  # (instance, window seconds)
    readings: tuple[Reading, ...]
    totals: tuple[Reading, ...]  # instance "total": counter ratios and rates over every instance
    found: tuple[str, ...]
    missing: tuple[str, ...]
    untiered: tuple[str, ...] = ()  # instances that export no counter or gauge of a tier below the device
    basis: Basis = Basis.window

    @property
    def untiered_note(self) -> str | None:
        """One sentence for every instance without tier counters (None when each has some): said once, where a
        0.0 % row per tier would claim a measurement nobody made."""
        if not self.untiered:
            return None
        who = ", ".join(self.untiered)
        if len(self.untiered) == len(self.instances):
            return f"no tier counters exported by {who}: this fleet reports no host/disk/object tier hits"
        return f"no tier counters exported by {who}: no host/disk/object tier hits from {_them(self.untiered)}"

    def missing_note(self, where: str) -> str | None:
        """One short line for the families `where` does not expose (None when it exposes all): how many, and
        whose (the engines named by their prefix); `families.missing` in -o json lists them one by one."""
        if not self.missing:
            return None
        whose = ", ".join(dict.fromkeys(_ENGINE_PREFIX.match(doc).group() for doc in self.missing))  # type: ignore[union-attr]
        return (f"not found at {where}: {len(self.missing)} of the {len(FAMILIES)} metric families kvctl reads "
                f"({whose}); -o json lists them")

    def to_dict(self) -> dict[str, Any]:
        return {"basis": self.basis.value,
                "instances": [{"instance": name, "window_s": seconds if math.isfinite(seconds) else None}
                              for name, seconds in self.instances],
                "readings": [r.to_dict() for r in self.readings], "totals": [r.to_dict() for r in self.totals],
                "families": {"found": list(self.found), "missing": list(self.missing)},
                "no_tier_counters": {"instances": list(self.untiered), "note": self.untiered_note}}


_ENGINE_PREFIX = re.compile(r"[a-z]+")
"""A family's engine: `vllm` of `vllm:prefix_cache_hits`, `kvbm` of `kvbm_matched_tokens`."""


def _them(instances: tuple[str, ...]) -> str:
    return "it" if len(instances) == 1 else "them"


def report(windows: Iterable[Window], *, instance: re.Pattern[str] | None = None) -> TierReport:
    """Every reading of every instance (those `instance` searches, when given), totals, and the families seen."""
    windows = list(windows)
    chosen = sorted((w for w in windows if instance is None or instance.search(w.instance)), key=lambda w: w.instance)
    instances = [_Instance.of(w) for w in chosen]
    readings = tuple(r for inst in instances for derive in _DERIVATIONS for r in derive(inst))
    found = {doc for inst in instances for doc, _ in inst.values}
    tiered = {r.instance for r in readings if r.tier in LOWER_TIERS}
    return TierReport(
        instances=tuple((w.instance, w.seconds) for w in chosen),
        readings=readings,
        totals=tuple(_totals(readings)),
        found=tuple(f.doc for f in FAMILIES if f.doc in found),
        missing=tuple(f.doc for f in FAMILIES if f.doc not in found),
        untiered=tuple(w.instance for w in chosen if w.instance not in tiered),
        basis=Basis.since_start if windows and all(math.isinf(w.seconds) for w in windows) else Basis.window,
    )


def _totals(readings: Iterable[Reading]) -> Iterator[Reading]:
    """Rates and counts add up; counter ratios are Σ numerators / Σ denominators; gauges have no total."""
    groups: dict[tuple[str | None, str, str, Kind], list[Reading]] = defaultdict(list)
    for r in readings:
        groups[r.tier, r.metric, r.family, r.kind].append(r)
    for (tier, metric, family, kind), group in groups.items():
        if kind is not Kind.ratio:
            yield Reading("total", tier, metric, sum(r.value or 0.0 for r in group), family, kind)
        elif all(r.parts is not None for r in group):
            numerator = sum(r.parts[0] for r in group if r.parts)
            denominator = sum(r.parts[1] for r in group if r.parts)
            yield Reading("total", tier, metric, ratio(numerator, denominator), family, kind,
                          (numerator, denominator))


def hit_rates(report: TierReport, tier: str) -> list[Reading]:
    """Each instance's hit rate for `tier`, preferring a ratio of counters over the window to a gauge."""
    best: dict[str, Reading] = {}
    for r in report.readings:
        if r.tier == tier and r.metric == "hit_rate" and r.value is not None:
            current = best.get(r.instance)
            if current is None or (current.parts is None and r.parts is not None):
                best[r.instance] = r
    return list(best.values())


class Status(StrEnum):
    """Nagios' statuses; the command maps them to exit codes 0..3."""

    OK = "OK"
    WARNING = "WARNING"
    CRITICAL = "CRITICAL"
    UNKNOWN = "UNKNOWN"


@dataclass(frozen=True, slots=True)
class CheckResult:
    status: Status
    message: str
    worst: Reading | None
    readings: tuple[Reading, ...]

    def nagios(self, warn: float | None, crit: float | None) -> str:
        """`KVCTL TIERS WARNING - … | 'instance'=value;warn;crit;0;1`, then each instance's hit rate a line: the
        plugin output monitoring systems parse (`kvctl.core.nagios`)."""
        perf = [Perf(r.instance, round(r.value, 4), warn=warn, crit=crit, min=0, max=1)
                for r in self.readings if r.value is not None]
        details = [f"{r.tier} hit rate {r.value:.1%} on {r.instance} ({r.family})" for r in self.readings
                   if r.value is not None and r is not self.worst]
        return plugin_output("tiers", self.status.value, self.message, perf, details)

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status.value, "message": self.message,
                "worst": None if self.worst is None else self.worst.to_dict()}


def check(report: TierReport, tier: str, *, warn: float | None, crit: float | None) -> CheckResult:
    """Nagios-style: the lowest hit rate of `tier` over the instances against the thresholds (lower is worse)."""
    readings = sorted(hit_rates(report, tier), key=lambda r: (r.value, r.instance))
    if not readings:
        quiet = any(r.tier == tier and r.metric == "hit_rate" for r in report.readings)
        why = "no traffic in the window" if quiet else "no family reports it"
        if not quiet and tier in LOWER_TIERS and report.untiered and len(report.untiered) == len(report.instances):
            why = f"no tier counters exported by {', '.join(report.untiered)}"
        return CheckResult(Status.UNKNOWN, f"no {tier} hit rate ({why})", None, ())
    worst = readings[0]
    assert worst.value is not None
    status = Status.OK
    if crit is not None and worst.value < crit:
        status = Status.CRITICAL
    elif warn is not None and worst.value < warn:
        status = Status.WARNING
    message = f"{tier} hit rate {worst.value:.1%} on {worst.instance} ({worst.family})"
    return CheckResult(status, message, worst, tuple(readings))


_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """Seconds in a Prometheus duration (`5m`, `1h30m`, `90s`); a bare integer is seconds. ValueError otherwise."""
    if text.isdigit():
        text += "s"
    if not text or _DURATION.sub("", text):
        raise ValueError(f"not a duration: {text!r} (e.g. 30s, 5m, 1h30m)")
    seconds = sum(int(n) * _UNIT_SECONDS[unit] for n, unit in _DURATION.findall(text))
    if seconds <= 0:
        raise ValueError(f"a window must be longer than 0, got {text!r}")
    return seconds
