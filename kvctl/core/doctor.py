"""The checks `kvctl doctor` runs: each turns what a router reports into findings an on-call engineer
can act on, naming the cause, the numbers that show it, and the command to run next.

Pure: the inputs are the router's own API objects (`/v1/status`, `/v1/workers`, `/busy_threshold`)
and, for replica divergence, per-peer tree diffs; the command gathers them. A check that finds
nothing wrong says so with an OK finding, so the report always shows what was looked at.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from kvctl.core.router.busy import THRESHOLD_FIELDS, BusyTracker, Thresholds, WorkerLoad
from kvctl.core.silence import SILENT_AFTER_S, is_silent
from kvctl.core.words import counted

DEFAULT_MODEL = "default"
SHOWN = 8
"""Workers named in one finding's evidence; the count says how many more there are."""


class Severity(IntEnum):
    """Nagios' statuses, valued as its exit codes; `worst` ranks them."""

    OK = 0
    WARNING = 1
    CRITICAL = 2
    UNKNOWN = 3


@dataclass(frozen=True)
class Finding:
    check: str  # stable id, for scripts: router, workers, silent, streams, block_size, hashing, busy, ...
    severity: Severity
    cause: str
    evidence: dict[str, Any] = field(default_factory=dict)
    next_step: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"check": self.check, "severity": self.severity.name, "cause": self.cause,
                "evidence": self.evidence, "next_step": self.next_step}


@dataclass(frozen=True)
class Limits:
    silent_after_s: float = SILENT_AFTER_S
    most_busy_share: float = 0.5  # WARNING when more than this share of a model's workers is busy
    kv_full_share: float = 0.9  # "extreme" load: KV usage of a worker's capacity, with no threshold set
    divergence_share: float = 0.01  # replicas may differ by this share of blocks (events in flight)
    nodes_per_block: float = 0.75  # nodes are compressed runs of blocks: near one per block, nothing is shared
    min_blocks_for_shape: int = 10_000  # below this, the node/block ratio says nothing
    near_cap: float = 0.9  # approximate mode: blocks as a share of --max-tree-size
    unreachable_after_s: float = 10.0  # a discovered publisher not connected by then is not reachable from here


@dataclass(frozen=True)
class PeerDiff:
    """A peer router compared with this one: blocks each holds per worker, and those only one holds."""

    url: str
    against: str  # this router's URL
    blocks: int
    differing: int
    workers: list[dict[str, Any]]


_RANK = {Severity.OK: 0, Severity.UNKNOWN: 1, Severity.WARNING: 2, Severity.CRITICAL: 3}
"""A known problem outranks a check that could not run; UNKNOWN outranks OK."""


def worst(findings: Iterable[Finding]) -> Severity:
    return max((f.severity for f in findings), key=_RANK.__getitem__, default=Severity.OK)


def _name(row: Mapping[str, Any]) -> str:
    return f"{row['worker_id']}:{row['dp_rank']}"


def _named(names: Sequence[str]) -> dict[str, Any]:
    return {"workers": list(names[:SHOWN]), "count": len(names)}


def _first(names: Sequence[str]) -> str:
    return names[0].split(":")[0] if names else "W"


# ----- 1. registration ------------------------------------------------------------------------------------

def check_registration(status: Mapping[str, Any], workers: Sequence[Mapping[str, Any]]) -> list[Finding]:
    if not workers:
        return [Finding("workers", Severity.CRITICAL, "no workers registered: every route is refused (503)",
                        {"models": sorted(status.get("models", {}))},
                        "register engines: kvctl serve --worker ID=tcp://HOST:PORT, or POST /v1/workers")]
    by_model: dict[str, int] = {}
    for row in workers:
        by_model[row["model"]] = by_model.get(row["model"], 0) + 1
    # the router always has the default model; it is empty, not broken, when workers serve named models
    empty = [m for m in status.get("models", {}) if m not in by_model and m != DEFAULT_MODEL]
    if empty:
        return [Finding("workers", Severity.WARNING, f"model {empty[0]!r} has no workers: its routes are refused",
                        {"models_without_workers": empty, "workers_by_model": by_model},
                        f"kvctl workers; register workers for {empty[0]!r} (POST /v1/workers with model_name)")]
    return [Finding("workers", Severity.OK, f"{counted(len(workers), 'worker')} registered",
                    {"workers_by_model": by_model})]


# ----- 2. silent workers ----------------------------------------------------------------------------------

def check_silent(status: Mapping[str, Any], workers: Sequence[Mapping[str, Any]], limits: Limits) -> list[Finding]:
    """Silence alone may be an idle fleet: an engine publishes events only when its cache changes. It is a
    fault for sure when the worker serves regardless: routes won with no event ever, requests in flight
    now, or messages arriving that deliver no event. CRITICAL only when every worker is silent and some
    are known to be serving: the router routes blind (Dynamo #4249: engines not emitting KV events)."""
    approximate = {m for m, stats in (status.get("models") or {}).items() if stats.get("approximate")}
    workers = [w for w in workers if w["model"] not in approximate]  # they publish no events, by design
    if not workers:
        return [Finding("silent", Severity.OK, "approximate mode: the router indexes its own routes, not events")]
    never = [_name(w) for w in workers if w.get("last_event_age_s") is None]
    stale = [(_name(w), w["last_event_age_s"]) for w in workers
             if w.get("last_event_age_s") is not None and is_silent(w["last_event_age_s"], limits.silent_after_s)]
    if not never and not stale:
        return [Finding("silent", Severity.OK, f"every worker sent events in the last {limits.silent_after_s:g} s")]
    silent = never + [n for n, _ in stale]
    serving = _serving_while_silent(status, [w for w in workers if _name(w) in silent], limits)
    severity = Severity.CRITICAL if len(silent) == len(workers) and serving else Severity.WARNING
    cause = (f"{len(silent)} of {len(workers)} workers silent: "
             + ", ".join(filter(None, [f"{len(never)} never sent an event" if never else "",
                                       f"{len(stale)} quiet for over {limits.silent_after_s:g} s" if stale else "",
                                       f"{len(serving)} of them serving regardless" if serving
                                       else "none known to be serving (idle, or not publishing?)"])))
    evidence = {**_named(silent), "never": never[:SHOWN], "quiet_s": dict(stale[:SHOWN]),
                "serving": dict(list(serving.items())[:SHOWN])}
    first = next(w for w in workers if _name(w) == silent[0])
    return [Finding("silent", severity, cause, evidence,
                    f"{_tap(first, status)}  (is worker {_first(silent)} publishing at all? check the engine's "
                    "kv-events config and the endpoint registered)")]


def _tap(worker: Mapping[str, Any], status: Mapping[str, Any]) -> str:
    """The command that shows a worker's raw KV events from where this router follows them: the ZMQ endpoint
    registered for it, the address its publisher advertises on the event plane, or the NATS event plane."""
    address = worker.get("endpoint") or (worker.get("event_plane") or {}).get("address")
    if address:
        return f"kvctl events tail --zmq {address} --worker-id {worker['worker_id']}"
    return _plane_tap(status) or (f"kvctl workers -o wide  (no KV-event endpoint is registered for worker "
                                  f"{worker['worker_id']}: its events can only come by POST /v1/events)")


def _plane_tap(status: Mapping[str, Any]) -> str | None:
    """The command that shows the raw messages of the event plane this router follows, if it follows one."""
    plane = status.get("event_plane") or {}
    scope = "".join(f" --{key} {plane[key]}" for key in ("namespace", "component") if plane.get(key))
    if plane.get("transport") == "zmq" and (plane.get("discovery") or {}).get("url"):
        return f"kvctl events tail --dynamo-discovery {plane['discovery']['url']}{scope}"
    if plane.get("url") and plane.get("transport") != "zmq":
        return f"kvctl events tail --nats {plane['url']}{scope}"
    return None


def _serving_while_silent(status: Mapping[str, Any], silent: Sequence[Mapping[str, Any]],
                          limits: Limits) -> dict[str, dict[str, Any]]:
    """Silent workers with signs of work: what each shows (routes won, requests in flight, messages)."""
    streams = {_stream_name(s): s for s in status.get("streams") or []}
    out: dict[str, dict[str, Any]] = {}
    for w in silent:
        name, stream = _name(w), streams.get(_name(w), {})
        signs = {}
        if w.get("last_event_age_s") is None and w.get("routes"):
            signs["routes"] = w["routes"]
        if w.get("active_requests"):
            signs["active_requests"] = w["active_requests"]
        message_at, event_at = stream.get("last_message_at"), stream.get("last_event_at")
        if message_at is not None and (event_at is None or message_at - event_at > limits.silent_after_s):
            signs["messages"] = stream.get("messages", 0)
        if signs:
            out[name] = signs
    return out


# ----- 3. streams: gaps, replays, restarts, decode errors --------------------------------------------------

def check_streams(status: Mapping[str, Any]) -> list[Finding]:
    streams = status.get("streams") or []
    findings: list[Finding] = [*_failed_streams(streams), *_decoder_died(status.get("decoder") or {})]
    lost = [(_stream_name(s), s) for s in streams
            if s.get("lost_batches") or s.get("replays_failed") or s.get("gapped")]
    if lost:
        names = [n for n, _ in lost]
        unreplayable = [n for n, s in lost if not s.get("replay_endpoint")]
        failed = [n for n, s in lost if s.get("replays_failed")]
        why = ", ".join(filter(None, [f"{len(unreplayable)} with no replay endpoint" if unreplayable else "",
                                      f"{len(failed)} whose replays failed" if failed else ""]))
        fix = ("register each engine's replay endpoint (POST /v1/workers replay_endpoint, or serve --worker "
               "ID=tcp://…,replay=tcp://…)" if unreplayable else
               "is the engine's replay ROUTER socket reachable, and its replay buffer large enough?")
        findings.append(Finding(
            "streams", Severity.WARNING,
            f"{counted(len(lost), 'stream')} lost batches that replay could not recover ({why}): their index may hold "
            "stale blocks or miss new ones",
            {**_named(names), "lost_batches": {n: s.get("lost_batches", 0) for n, s in lost[:SHOWN]},
             "gaps": {n: s.get("gaps", 0) for n, s in lost[:SHOWN]},
             "replays_failed": {n: s.get("replays_failed", 0) for n, s in lost[:SHOWN]},
             "replay_endpoint": {n: s.get("replay_endpoint") for n, s in lost[:SHOWN]}},
            f"kvctl router reset --worker {_first(names)} --yes  (resync it); then {fix}"))
    restarted = [(_stream_name(s), s["restarts"]) for s in streams if s.get("restarts")]
    if restarted:
        findings.append(Finding(
            "restarts", Severity.WARNING,
            f"{counted(len(restarted), 'engine')} restarted; each restart cleared the worker",
            {**_named([n for n, _ in restarted]), "restarts": dict(restarted[:SHOWN])},
            "check the engines' logs for crashes or OOM kills; kvctl router status"))
    broken = [(_stream_name(s), s) for s in streams if s.get("decode_errors")]
    plane = status.get("event_plane") or {}
    if broken or plane.get("decode_errors"):
        errors: dict[str, dict[str, int]] = {n: s["decode_errors"] for n, s in broken[:SHOWN]}
        if plane.get("decode_errors"):
            errors["event_plane"] = plane["decode_errors"]
        findings.append(Finding(
            "decode", Severity.WARNING,
            "events that could not be decoded were skipped: an engine speaks a format or version the router "
            "does not expect",
            {"decode_errors": errors, "schema_seen": {n: s.get("schema", {}) for n, s in broken[:SHOWN]}},
            f"{_decode_tap(broken, status)}  (see the raw events; compare the schema with the engine's version)"))
    if not findings:
        gaps = sum(s.get("gaps", 0) for s in streams)
        repaired = f", {counted(gaps, 'gap')} repaired by replay" if gaps else ""
        findings.append(Finding("streams", Severity.OK, f"{counted(len(streams), 'engine stream')} whole{repaired}",
                                {"gaps": gaps}))
    return findings


def _decode_tap(broken: Sequence[tuple[str, Mapping[str, Any]]], status: Mapping[str, Any]) -> str:
    """Where to watch the undecodable events: the first such engine's endpoint, else the event plane."""
    if broken:
        stream = broken[0][1]
        return _tap({**stream["worker"], "endpoint": stream.get("endpoint")}, status)
    return _plane_tap(status) or "kvctl router status"


def _failed_streams(streams: Sequence[Mapping[str, Any]]) -> list[Finding]:
    """Streams that died of an error: CRITICAL while one is down (its worker's events are not read), WARNING
    once every one runs again (what went by meanwhile was replayed or counted lost)."""
    failed = [(_stream_name(s), s) for s in streams if s.get("failures")]
    if not failed:
        return []
    down = [n for n, s in failed if s.get("state") == "failed"]
    names = down or [n for n, _ in failed]
    cause = (f"{counted(len(down), 'engine stream')} failed, not reading their engines' events (retried with "
             "backoff)" if down else f"{counted(len(failed), 'engine stream')} failed and ran again")
    return [Finding(
        "streams", Severity.CRITICAL if down else Severity.WARNING, cause,
        {**_named(names), "last_error": {n: s.get("last_error") for n, s in failed[:SHOWN]},
         "failures": {n: s.get("failures") for n, s in failed[:SHOWN]}},
        "see the router's log for the error (out of file descriptors? raise ulimit -n, or lower --max-engines)")]


def _decoder_died(decoder: Mapping[str, Any]) -> list[Finding]:
    """The decode process died: its streams read in the router's loop since, which routes then share."""
    if not decoder.get("restarts") and not decoder.get("failed"):
        return []
    state = ("it is down: the router decodes in its own loop until a new one starts" if decoder.get("failed")
             else f"it was started again {counted(decoder['restarts'], 'time')}")
    return [Finding("decoder", Severity.WARNING, f"the decode process died ({decoder.get('last_error')}); {state}",
                    {"decoder": dict(decoder)}, "see the router's log for why it exited (out of memory? killed?)")]


def _stream_name(stream: Mapping[str, Any]) -> str:
    return _name(stream["worker"])


# ----- 4. block size -----------------------------------------------------------------------------------------

def check_block_size(status: Mapping[str, Any], workers: Sequence[Mapping[str, Any]]) -> list[Finding]:
    model_of = {_name(w): w["model"] for w in workers}
    models = status.get("models", {})
    wrong: dict[str, dict[str, Any]] = {}
    for s in status.get("streams") or []:
        name = _stream_name(s)
        expected = models.get(model_of.get(name, DEFAULT_MODEL), {}).get("block_size")
        seen = [b for b in s.get("schema", {}).get("block_sizes", []) if b != expected]
        if expected is not None and seen:
            wrong[name] = {"engine": sorted(s["schema"]["block_sizes"]), "router": expected}
    if not wrong:
        return [Finding("block_size", Severity.OK, "engines' block sizes match their models'")]
    names = list(wrong)
    first = wrong[names[0]]
    return [Finding(
        "block_size", Severity.CRITICAL,
        f"block size mismatch: worker {names[0]} publishes {first['engine']}-token blocks, its model uses "
        f"{first['router']}: its blocks never match a request, so its overlap is always zero",
        {**_named(names), "block_sizes": {n: wrong[n] for n in names[:SHOWN]}},
        f"set the router's --block-size (or the model's block_size) to the engine's {first['engine'][0]}, "
        "or the engine's to the router's")]


def check_hit_rates(engines: Mapping[str, float], predicted: float | None, *,
                    zero: float = 0.05, high: float = 0.3, predicted_by: str | None = None) -> list[Finding]:
    """Engines' own prefix-cache hit rates against the router's predicted hit rate (both since start).

    An engine's hit rate is its prefix cache's (vLLM, SGLang, a Dynamo worker's gauge) or, for engines that
    export none (Dynamo's mocker), the share of prompt tokens they reported cached to a Dynamo frontend.
    `predicted_by` names the metric the prediction came from (kvctl's router, or Dynamo's).
    Engines that find their prefixes cached while the router predicts no overlap means the router's
    blocks never match the engines' (block size, hash seed, LoRA or salt): it routes blind."""
    if not engines:
        return [Finding("hit_rate", Severity.UNKNOWN, "no engine prefix-cache hit rate in the metrics given",
                        {}, "kvctl tiers --metrics URL  (which families do the engines expose?)")]
    mean = round(sum(engines.values()) / len(engines), 3)
    evidence = {"engines": {k: round(v, 3) for k, v in list(engines.items())[:SHOWN]}, "engines_mean": mean,
                "router_predicted": None if predicted is None else round(predicted, 3),
                "router_predicted_by": predicted_by}
    if predicted is None:
        return [Finding("hit_rate", Severity.UNKNOWN, "the router has routed nothing yet: no prediction to compare",
                        evidence, "kvctl route TOKENS --explain")]
    if predicted < zero and mean >= high:
        return [Finding(
            "hit_rate", Severity.CRITICAL,
            f"the router predicts {predicted:.0%} cache hits while engines hit {mean:.0%} of prompt tokens: "
            "router and engines disagree on blocks, so routing ignores the cache",
            evidence, "kvctl doctor's block_size and hashing findings; kvctl hash TOKENS vs the engine's hashes")]
    return [Finding("hit_rate", Severity.OK,
                    f"router predicts {predicted:.0%} hits, engines hit {mean:.0%}", evidence)]


# ----- 5. engine hashing ---------------------------------------------------------------------------------------

def check_hashing(workers: Sequence[Mapping[str, Any]]) -> list[Finding]:
    mismatched = [(_name(w), w["hash_mismatches"]) for w in workers if w.get("hash_mismatches")]
    missing = [(_name(w), w.get("rejected_events", {}).get("block_not_found", 0)) for w in workers
               if w.get("rejected_events", {}).get("block_not_found")]
    if mismatched:
        odd = odd_hashers(workers)
        names = odd or [n for n, _ in mismatched]
        evidence = {**_named(names), "mismatched_blocks": dict(mismatched[:SHOWN]),
                    "agreeing_blocks": {_name(w): w.get("hash_agreements", 0) for w in workers[:SHOWN]},
                    "removals_not_found": dict(missing[:SHOWN])}
        fix = ("give every engine the same hash seed (vLLM: PYTHONHASHSEED, or --prefix-caching-hash-algo "
               "sha256_cbor); kvctl hash <tokens> shows the hashes the router expects")
        if odd:
            shown = ", ".join(odd[:SHOWN])
            who = f"worker {shown} hashes blocks" if len(odd) == 1 else f"workers {shown} hash blocks"
            return [Finding(
                "hashing", Severity.CRITICAL,
                f"{who} unlike the rest of their model: they stored known "
                "token paths under other block hashes (Dynamo's \"block_hash mismatch\") more often than under the "
                "same, while the other workers agree, so their prefixes are not shared",
                evidence, f"worker {_first(odd)}'s engine: the other engines' hash seed and block size; {fix}")]
        return [Finding(
            "hashing", Severity.CRITICAL,
            f"non-deterministic engine hashing: {counted(len(names), 'worker')} stored known token paths under other "
            "block hashes (Dynamo's \"block_hash mismatch\"), so their removals miss and prefixes are not shared",
            evidence, fix)]
    if missing:
        return [Finding(
            "hashing", Severity.WARNING,
            f"{counted(len(missing), 'worker')} removed blocks the router never saw stored: events were lost or "
            "the engine's hashes changed",
            {**_named([n for n, _ in missing]), "removals_not_found": dict(missing[:SHOWN])},
            "kvctl router status  (gaps? restarts?); kvctl router reset --worker W --yes to resync")]
    return [Finding("hashing", Severity.OK, "engines agree on block hashes")]


def odd_hashers(workers: Sequence[Mapping[str, Any]]) -> list[str]:
    """The workers that hash unlike the rest of their model: more of their stores on known token paths
    disagreed with the indexed hashes than agreed, while the model's other workers agree with each other
    (some agreement, fewer than half the workers odd). Empty when no such rest exists: when every engine
    hashes its own way, or two disagree with no third to side with, no single worker is to blame."""
    by_model: dict[str, list[Mapping[str, Any]]] = {}
    for w in workers:
        by_model.setdefault(w["model"], []).append(w)
    odd = []
    for rows in by_model.values():
        standing = [w for w in rows if (w.get("hash_mismatches") or 0) > (w.get("hash_agreements") or 0)]
        agreeing = any(w.get("hash_agreements") for w in rows if w not in standing)
        if agreeing and 2 * len(standing) < len(rows):
            odd += [_name(w) for w in standing]
    return odd


def check_partial(workers: Sequence[Mapping[str, Any]]) -> list[Finding]:
    """A worker whose stores name parents the router never saw joined mid-stream (the router started after
    its engine, with no replay) or lost events: what hangs below those parents is missing from the index."""
    orphans = [(_name(w), w.get("rejected_events", {}).get("parent_block_not_found", 0)) for w in workers
               if w.get("rejected_events", {}).get("parent_block_not_found")]
    if not orphans:
        return []
    names = [n for n, _ in orphans]
    return [Finding(
        "partial", Severity.WARNING,
        f"{counted(len(orphans), 'worker')} stored blocks under parents the router never saw: it joined their streams "
        "mid-way (or lost events), so its index holds only part of what they cache and routes them too few hits",
        {**_named(names), "rejected_for_unknown_parent": dict(orphans[:SHOWN])},
        f"register the engine's replay endpoint (kvctl serve --worker {_first(names)}=tcp://…,replay=tcp://…), or "
        "accept the gap until those prefixes are evicted and stored again; kvctl workers -o wide")]


def check_recovery(status: Mapping[str, Any]) -> list[Finding]:
    """A worker found late on the ZMQ plane (no history) whose index could not be recovered over Dynamo's
    request plane is followed from its live events only: what it stored before is missing from the index."""
    rows = (status.get("event_plane") or {}).get("workers") or []
    failed = [(_name(r), r["recovery"].get("reason")) for r in rows
              if (r.get("recovery") or {}).get("state") == "partial"]
    if not failed:
        return []
    names = [n for n, _ in failed]
    return [Finding(
        "partial", Severity.WARNING,
        f"{counted(len(failed), 'worker')} could not be recovered over Dynamo's request plane: the router follows "
        "their "
        "live events only, so its index lacks what they stored before it found them",
        {**_named(names), "reasons": dict(failed[:SHOWN])},
        "make each worker's recovery_target (v1/event_sources) reachable from kvctl, and kvctl's listener from "
        "the worker, then restart kvctl serve; or accept the gap until those prefixes are stored again")]


# ----- the Dynamo event plane (NATS) ----------------------------------------------------------------------

def check_event_plane(status: Mapping[str, Any], workers: Sequence[Mapping[str, Any]],
                      limits: Limits) -> list[Finding]:
    """A router following an event plane (NATS, or Dynamo's ZMQ plane through discovery) that delivers
    nothing in its scope is misconfigured, not idle: Dynamo workers report forward passes and load all the
    time. Name what it follows and what the namespace does carry; on the ZMQ plane, publishers it cannot
    reach; then lost messages and workers whose reports stopped."""
    plane = status.get("event_plane")
    if not plane:
        return []
    findings: list[Finding] = []
    topics = plane.get("topics") or {}
    followed_s = plane.get("following_s")
    # with no worker known, nothing has come at all: say why now; with some, only silence beyond the limit
    quiet_for = limits.silent_after_s if workers else 0.0
    zmq = plane.get("transport") == "zmq"
    if zmq:
        findings += _unreachable_publishers(plane, limits)
    quiet = plane.get("ready") and followed_s is not None and followed_s > quiet_for and not any(topics.values())
    if quiet and not (zmq and plane.get("connections")):  # publishers followed: reached or not, said above
        findings.append(_nothing_in_scope(plane, followed_s))
    lost = (plane.get("sequence") or {}).get("lost", 0)
    lost_events = (plane.get("counts") or {}).get("lost_events", 0)
    if lost or lost_events:
        gapped = [p for p in plane.get("publishers") or [] if p.get("lost")]
        findings.append(Finding(
            "event_plane", Severity.WARNING,
            f"the event plane lost {counted(lost, 'message')} "
            f"({counted(len(gapped), 'publisher')} with sequence gaps) and "
            f"{counted(lost_events, 'KV event')} (event ids skipped)",
            {"publishers": [{k: p.get(k) for k in ("publisher_id", "topic", "lost", "workers")}
                            for p in gapped[:SHOWN]], "counts": plane.get("counts", {})},
            "the plane (NATS Core, or ZMQ PUB sockets) drops what a slow or disconnected subscriber misses: "
            "kvctl router status; "
            "kvctl router reset --worker W --yes to resync a worker whose KV events were lost"))
    stopped = [(_name(w), w["forward_pass"]["age_s"]) for w in workers
               if (w.get("forward_pass") or {}).get("age_s", 0) > limits.silent_after_s]
    if stopped:
        findings.append(Finding(
            "event_plane", Severity.WARNING,
            f"{counted(len(stopped), 'worker')} stopped reporting forward passes (every Dynamo worker reports each "
            f"pass, idle or not): stopped, hung or cut off for over {limits.silent_after_s:g} s",
            {**_named([n for n, _ in stopped]), "last_report_s": dict(stopped[:SHOWN])},
            "is the worker process alive? kvctl workers -o wide; once it is gone for good: "
            f"kvctl router reset --worker {_first([n for n, _ in stopped])} --yes"))
    if not findings:
        findings.append(Finding("event_plane", Severity.OK,
                                f"event plane: {counted(sum(topics.values()), 'message')} in scope, none lost",
                                {"topics": topics}))
    return findings


def _nothing_in_scope(plane: Mapping[str, Any], followed_s: float) -> Finding:
    """Nothing at all in the scope: what is followed, what the namespace carries instead, and where to look."""
    subjects = plane.get("subjects") or {}
    seen = plane.get("subjects_seen") or {}
    pattern = subjects.get("kv_events", "")
    ns = plane.get("namespace")
    zmq = plane.get("transport") == "zmq"
    tail = (f"kvctl events tail --dynamo-discovery {plane.get('url')} --namespace {ns}" if zmq
            else f"kvctl events tail --nats {plane.get('url')} --namespace {ns}")
    if seen:
        other = "other channel" if zmq else "other subject"
        cause = (f"0 messages on {pattern} in {followed_s:.0f} s; the namespace carries {counted(len(seen), other)}: "
                 "the component or endpoint does not match")
        fix = (f"restart kvctl serve with --component/--endpoint from the {'channels' if zmq else 'subjects'} "
               "seen (or neither: all)")
    elif zmq:
        listings = (plane.get("discovery") or {}).get("listings", 0)
        cause = (f"no event-channel record of namespace {ns!r} in {plane.get('url')} ({listings} listings in "
                 f"{followed_s:.0f} s): no publisher to follow")
        fix = ("check --namespace and that this is the fleet's store (its DYN_FILE_KV or ETCD_ENDPOINTS); a fleet "
               "whose workers publish through a ZMQ broker (DYN_ZMQ_BROKER_URL) files no records, and one run "
               "with --event-plane nats publishes on NATS (kvctl serve --nats URL)")
    else:
        cause = f"0 messages on {pattern} in {followed_s:.0f} s, and nothing at all in namespace {ns!r}"
        fix = ("check --namespace and the NATS URL; Dynamo 1.6.1 publishes on NATS only with --event-plane nats "
               "(its default is the ZMQ event plane: kvctl serve --dynamo-discovery STORE)")
    return Finding("event_plane", Severity.CRITICAL, cause,
                   {"subscription": subjects.get("subscription"), "following": pattern,
                    "subjects_seen": dict(list(seen.items())[:SHOWN])}, f"{fix}; {tail}")


def _unreachable_publishers(plane: Mapping[str, Any], limits: Limits) -> list[Finding]:
    """Records whose advertised endpoint this router never reached: a loopback or unspecified address is a
    worker that did not set DYN_EVENT_PLANE_HOST; any other, a port closed, filtered or long gone."""
    never = [c for c in plane.get("connections") or []
             if not c.get("connected") and not c.get("connects") and c.get("age_s", 0) > limits.unreachable_after_s]
    if not never:
        return []
    local = [c for c in never if not _routable(c.get("address", ""))]
    kv = sum(c.get("topic") == "kv-events" for c in never)
    cause = (f"{counted(len(never), 'publisher')} in discovery never reached for over {limits.unreachable_after_s:g} s "
             f"({kv} of them KV events: those workers' blocks never reach the index)")
    if local:
        cause += f"; {len(local)} advertise an address only their own host can reach ({local[0].get('address')})"
        fix = ("set DYN_EVENT_PLANE_HOST on those workers to an address this router can reach, or run kvctl on "
               "their host")
    else:
        fix = ("check the port is open from this host (firewall, network policy) and the process is alive; a dead "
               "process's records vanish within 10 s")
    return [Finding("event_plane", Severity.CRITICAL if kv else Severity.WARNING, cause,
                    {"publishers": [{k: c.get(k) for k in ("address", "topic", "publisher_id", "channel")}
                                    for c in never[:SHOWN]], "count": len(never)},
                    f"{fix}; kvctl router status")]


def _routable(address: str) -> bool:
    """Whether a `tcp://HOST:PORT` can be reached from another host: not loopback, unspecified or link-local."""
    host = address.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    if host == "localhost":
        return False
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return True  # a name: routable as far as this can tell
    return not (ip.is_loopback or ip.is_unspecified or ip.is_link_local)


# ----- 6. busy ----------------------------------------------------------------------------------------------

def check_busy(workers: Sequence[Mapping[str, Any]], thresholds: Sequence[Mapping[str, Any]],
               limits: Limits) -> list[Finding]:
    set_for = {t["model"]: {k: t[k] for k in THRESHOLD_FIELDS if t.get(k) is not None} for t in thresholds}
    findings: list[Finding] = []
    by_model: dict[str, list[Mapping[str, Any]]] = {}
    for w in workers:
        by_model.setdefault(w["model"], []).append(w)
    for model, rows in sorted(by_model.items()):
        busy = [w for w in rows if w.get("busy")]
        if busy and (len(busy) == len(rows) or len(busy) > limits.most_busy_share * len(rows)):
            findings.append(_busy_finding(model, rows, busy, set_for.get(model, {})))
        elif not set_for.get(model):
            full = [(_name(w), share) for w in rows if (share := _kv_share(w)) is not None
                    and share >= limits.kv_full_share]
            if full:
                findings.append(Finding(
                    "busy", Severity.WARNING,
                    f"{counted(len(full), 'worker')} of {model!r} using over {limits.kv_full_share:.0%} of their "
                    "KV cache "
                    "and no busy threshold is set: the router keeps sending them work",
                    {**_named([n for n, _ in full]), "kv_share": dict(full[:SHOWN])},
                    f"kvctl busy set --model {model} --active-decode-blocks-threshold 0.9"))
    if not findings:
        findings.append(Finding("busy", Severity.OK, "no model has most of its workers busy"))
    return findings


def _busy_finding(model: str, rows: Sequence[Mapping[str, Any]], busy: Sequence[Mapping[str, Any]],
                  thresholds: Mapping[str, Any]) -> Finding:
    """All or most workers busy, naming the thresholds that trip: judged again from each row's loads by the
    router's own busy checks, as `/v1/workers` says that a worker is busy but not why."""
    tracker, limits = BusyTracker(), Thresholds(**thresholds)
    tripped: dict[str, list[str]] = {}
    signals: dict[str, int] = {}
    for w in busy:
        reported = w.get("reported") or {}
        load = WorkerLoad(w.get("active_decode_blocks") or 0, w.get("active_prefill_tokens") or 0,
                          kv_used_blocks=reported.get("kv_used_blocks"), total_blocks=w.get("total_blocks"))
        reasons = tracker.update((w["worker_id"], w["dp_rank"]), load, limits).reasons
        tripped[_name(w)] = [str(r) for r in reasons]
        for reason in reasons:
            signals[reason.signal.value] = signals.get(reason.signal.value, 0) + 1
    names = [_name(w) for w in busy]
    evidence = {"thresholds": dict(thresholds), "tripped_by": signals, **_named(names),
                "tripped": {n: tripped[n] for n in names[:SHOWN]},
                "loads": {_name(w): {"active_decode_blocks": w.get("active_decode_blocks"),
                                     "active_prefill_tokens": w.get("active_prefill_tokens")} for w in rows[:SHOWN]}}
    which = ", ".join(signals) or "a threshold"
    if len(busy) == len(rows):
        return Finding("busy", Severity.CRITICAL,
                       f"every worker of {model!r} is busy ({which} over its threshold): its requests are "
                       "refused (503)", evidence,
                       f"add capacity, or raise the thresholds: kvctl busy set --model {model} ...")
    return Finding("busy", Severity.WARNING,
                   f"{len(busy)} of {len(rows)} workers of {model!r} are busy ({which} over its threshold)",
                   evidence, f"kvctl workers; kvctl busy get --model {model}")


def _kv_share(worker: Mapping[str, Any]) -> float | None:
    total = worker.get("total_blocks")
    if not total:
        return None
    reported = worker.get("reported") or {}
    used = reported.get("kv_used_blocks")
    used = used if used is not None else worker.get("active_decode_blocks")
    return None if used is None else round(used / total, 3)


# ----- 7. replicas ---------------------------------------------------------------------------------------------

def differing_workers(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> list[tuple[str, str, int, int]]:
    """(model, worker, blocks here, blocks there) for each worker whose block count differs between two
    routers' `models` objects (`/v1/status`): the workers a diff of the whole indexes would name, found from
    two small answers. Equal counts over different blocks go unseen: the price of not reading 1M blocks twice."""
    out = []
    for model in sorted(mine.keys() | theirs.keys()):
        here, there = mine.get(model, {}).get("workers", {}), theirs.get(model, {}).get("workers", {})
        out += [(model, w, here.get(w, 0), there.get(w, 0)) for w in sorted(here.keys() | there.keys())
                if here.get(w, 0) != there.get(w, 0)]
    return out


def check_divergence(peers: Sequence[PeerDiff], limits: Limits) -> list[Finding]:
    findings = []
    for peer in peers:
        share = peer.differing / peer.blocks if peer.blocks else (1.0 if peer.differing else 0.0)
        if share <= limits.divergence_share:
            findings.append(Finding("divergence", Severity.OK,
                                    f"{peer.url} agrees ({peer.differing} of {peer.blocks} blocks differ)",
                                    {"peer": peer.url, "share": round(share, 4)}))
            continue
        differing = [w for w in peer.workers if w["only_a"] or w["only_b"]]
        findings.append(Finding(
            "divergence", Severity.WARNING,
            f"replica {peer.url} disagrees on {share:.1%} of blocks ({peer.differing} of {peer.blocks}): "
            "the replicas route the same request differently",
            {"peer": peer.url, "share": round(share, 4), "workers": differing[:SHOWN], "count": len(differing)},
            f"kvctl tree diff {peer.against} {peer.url} --limit 20  (missed events? replica sync off?)"))
    return findings


# ----- 8. index health -----------------------------------------------------------------------------------------

def check_index(status: Mapping[str, Any], limits: Limits) -> list[Finding]:
    findings: list[Finding] = []
    drops = [q for q in status.get("queues") or [] if q.get("dropped_batches")]
    if drops:
        findings.append(Finding(
            "queues", Severity.CRITICAL,
            "event queues overflowed: batches were dropped, so the index misses blocks",
            {"queues": drops},
            "the writer cannot keep up: fewer workers per router, or kvctl router status to see the rate"))
    for model, stats in sorted((status.get("models") or {}).items()):
        blocks, nodes = stats.get("blocks", 0), stats.get("nodes", 0)
        cap = (stats.get("approximate") or {}).get("max_tree_size")
        if cap and blocks >= limits.near_cap * cap:
            findings.append(Finding(
                "index", Severity.WARNING,
                f"model {model!r}: {counted(blocks, 'block')}, {blocks / cap:.0%} of the approximate-mode cap {cap}: "
                "pruning keeps evicting what the router learnt from its own routes",
                {"model": model, "blocks": blocks, "max_tree_size": cap},
                "raise --max-tree-size, or lower --router-ttl so blocks expire before the cap prunes them"))
        if blocks >= limits.min_blocks_for_shape and nodes / blocks > limits.nodes_per_block:
            rss = status.get("rss_bytes")
            findings.append(Finding(
                "index", Severity.WARNING,
                f"model {model!r}: {counted(nodes, 'node')} for {counted(blocks, 'block')}: the index is short "
                "branches nobody shares "
                "(the tree compresses shared runs of blocks into one node; here there are none), the shape that "
                "costs the most memory per block",
                {"model": model, "blocks": blocks, "nodes": nodes, "nodes_per_block": round(nodes / blocks, 3),
                 "router_rss_bytes_per_block": None if not rss else round(rss / blocks)},
                "kvctl tree stats  (shared prefixes? per-request salts or LoRA names splitting the tree?)"))
    if not findings:
        total = sum(s.get("blocks", 0) for s in (status.get("models") or {}).values())
        findings.append(Finding("index", Severity.OK,
                                f"index holds {counted(total, 'block')}; no queue dropped events"))
    return findings


def diagnose(status: Mapping[str, Any], workers: Sequence[Mapping[str, Any]],
             thresholds: Sequence[Mapping[str, Any]], peers: Sequence[PeerDiff] = (),
             limits: Limits | None = None, hit_rates: list[Finding] | None = None) -> list[Finding]:
    """Every check, worst first; registration problems make the rest moot, so they come alone.
    `hit_rates`: `check_hit_rates`' finding, when engines' metrics were read."""
    limits = limits or Limits()
    registration = check_registration(status, workers)
    plane = check_event_plane(status, workers, limits)
    if worst(registration) is Severity.CRITICAL:
        return sorted([*registration, *plane], key=lambda f: -_RANK[f.severity])  # the plane may say why
    findings = [*registration, *check_silent(status, workers, limits), *check_streams(status), *plane,
                *check_block_size(status, workers), *check_hashing(workers), *check_partial(workers),
                *check_recovery(status),
                *check_busy(workers, thresholds, limits), *check_divergence(peers, limits),
                *check_index(status, limits), *(hit_rates or [])]
    return sorted(findings, key=lambda f: -_RANK[f.severity])
