"""Doctor's checks of what engine streams publish that Dynamo 1.6.1 does not index: hybrid models' groups, remote
or owned tiers, salts, EAGLE pairs, undeclared DP ranks (docs/contract.md, "Which engine events are indexed").

Each is handled as Dynamo handles it, so most are facts to know (INFO), not faults. What makes the index miss
blocks an engine holds is a WARNING, and a stream whose events are all dropped, so that nothing is indexed
while its engine publishes, is CRITICAL: the empty answer must not pass for a quiet fleet.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvctl.core.doctor.findings import SHOWN, Finding, Severity, first_id, named, stream_name
from kvctl.core.events.engine_fields import GROUP_DROPS, Dropped
from kvctl.core.words import counted

_BY_DESIGN = frozenset({Dropped.unsupported_ownership, Dropped.unknown_ownership, Dropped.non_local_locality,
                        *GROUP_DROPS}) - {Dropped.unknown_kind}
"""Causes that are Dynamo's design (a remote tier, a sliding window): the blocks are not this worker's to route to."""


def check_engine_events(status: Mapping[str, Any]) -> list[Finding]:
    """Drops by cause, hybrid models, salts, EAGLE pairs and DP ranks no worker was registered with."""
    streams = status.get("streams") or []
    return [*_dropped(streams), *_hybrid(streams), *_salted(streams), *_eagle(streams)]


def hashing_by_design(status: Mapping[str, Any]) -> dict[str, str]:
    """Per stream whose engine hashes blocks unlike other engines by its configuration: why. Its hashes and token
    blocks do not pair one to one (vLLM's lookahead tokens, token ids beyond its hashes), so the same tokens come
    under other block hashes than another engine's, as Dynamo sees them too: not a hash seed gone wrong."""
    out = {}
    for stream in status.get("streams") or []:
        shapes = set((stream.get("schema") or {}).get("token_shapes") or ())
        reasons = [why for shape, why in (("lookahead", "lookahead tokens (vLLM num_hash_lookahead_tokens)"),
                                          ("surplus", "token ids beyond its block hashes")) if shape in shapes]
        if reasons:
            out[stream_name(stream)] = ", ".join(reasons)
    return out


def undeclared_ranks(status: Mapping[str, Any]) -> dict[str, list[int]]:
    """Per registered stream (`stream_name`) whose engine published under DP ranks other than its own: those ranks.
    Dynamo indexes them there, so the registered rank is quiet by mistake of registration, not silent."""
    out: dict[str, list[int]] = {}
    for stream in status.get("streams") or []:
        ranks = sorted(set((stream.get("schema") or {}).get("dp_ranks") or ()) - {stream["worker"]["dp_rank"]})
        if ranks:
            out[stream_name(stream)] = ranks
    return out


def _dropped(streams: Sequence[Mapping[str, Any]]) -> list[Finding]:
    rows = [(stream_name(s), s) for s in streams if s.get("events_dropped")]
    if not rows:
        return []
    emptied_rows = [s for _, s in rows if not s.get("events") and s.get("messages")]
    emptied = [stream_name(s) for s in emptied_rows]
    causes: dict[str, int] = {}
    for _, s in rows:
        for cause, n in s["events_dropped"].items():
            causes[cause] = causes.get(cause, 0) + n
    evidence = {**named([n for n, _ in rows]), "events_dropped": {n: s["events_dropped"] for n, s in rows[:SHOWN]}}
    if emptied:
        endpoint = emptied_rows[0].get("endpoint") or f"<worker {first_id(emptied)}'s endpoint>"
        return [Finding(
            "dropped", Severity.CRITICAL,
            f"every event of {counted(len(emptied), 'engine stream')} was dropped as Dynamo drops it "
            f"({_causes(causes)}): nothing of theirs is indexed while they publish, so every overlap with them is 0",
            {**evidence, "emptied": emptied[:SHOWN]},
            f"{_fix(causes)}; kvctl events tail --zmq {endpoint}  (what it sends)")]
    faults = {c: n for c, n in causes.items() if c not in _BY_DESIGN}
    if faults:
        return [Finding(
            "dropped", Severity.WARNING,
            f"events dropped or cut that the engines meant to be indexed ({_causes(faults)}): the index misses "
            "blocks the engines hold",
            evidence, _fix(faults))]
    return [Finding("dropped", Severity.OK,
                    f"events not indexed by design, as Dynamo does ({_causes(causes)}): remote, owned or "
                    "non-full-attention blocks are not the worker's to route to", evidence)]


def _causes(causes: Mapping[str, int]) -> str:
    return ", ".join(f"{cause} {n}" for cause, n in sorted(causes.items(), key=lambda kv: -kv[1]))


def _fix(faults: Mapping[str, int]) -> str:
    if Dropped.block_size_mismatch.value in faults:
        return "serve --block-size B with the engines' block size (kvctl router status shows the schema's)"
    if Dropped.unknown_medium.value in faults or Dropped.unknown_kind.value in faults:
        return "an engine newer than Dynamo 1.6.1's table: kvctl router status shows the media and kinds it sends"
    return "kvctl router status  (events_dropped per stream); docs/contract.md says what each cause means"


def _hybrid(streams: Sequence[Mapping[str, Any]]) -> list[Finding]:
    hybrid = [(stream_name(s), s["groups"]) for s in streams if len(s.get("groups") or ()) > 1]
    if not hybrid:
        return []
    unnamed = [name for name, groups in hybrid if sum(g.get("kind") is None for g in groups) > 1]
    evidence = {**named([n for n, _ in hybrid]), "groups": dict(hybrid[:SHOWN])}
    if unnamed:
        return [Finding(
            "groups", Severity.WARNING,
            f"{counted(len(unnamed), 'engine')} publish several KV cache groups without kv_cache_spec_kind: group 0 is "
            "indexed whatever it is (a sliding window's removes then empty it), the others dropped",
            {**evidence, "unnamed": unnamed[:SHOWN]},
            "an engine that names its groups' kinds (vLLM >= 0.33 does)")]
    return [Finding("groups", Severity.OK,
                    f"hybrid model: {counted(len(hybrid), 'engine')} publish several KV cache groups; their "
                    "full-attention groups are indexed, the others (sliding window, Mamba, ...) dropped, as Dynamo "
                    "does", evidence)]


def _salted(streams: Sequence[Mapping[str, Any]]) -> list[Finding]:
    salted = [(stream_name(s), s["salts_seen"]) for s in streams if s.get("salts_seen")]
    if not salted:
        return []
    return [Finding("salts", Severity.OK,
                    f"salted cache: {counted(len(salted), 'engine')} stored blocks under cache salts; a route matches "
                    "them only with the same cache_salt (kvctl route --cache-salt)",
                    {**named([n for n, _ in salted]), "salts_seen": dict(salted[:SHOWN])})]


def _eagle(streams: Sequence[Mapping[str, Any]]) -> list[Finding]:
    eagle = [stream_name(s) for s in streams if "pairs" in ((s.get("schema") or {}).get("token_shapes") or ())]
    if not eagle:
        return []
    return [Finding("eagle", Severity.OK,
                    f"EAGLE: {counted(len(eagle), 'engine')} store token pairs (SGLang speculative decoding); their "
                    "blocks hash one token more each, so only EAGLE-hashed routes match them (a model card with "
                    "enable_eagle)", named(eagle))]
