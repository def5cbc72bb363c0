"""Doctor's checks of the fleet and the index: registration, block size, engine hashing, busy workers,
replica divergence and index health, and `diagnose`, which runs every check (the event flow's too)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from kvctl.core.doctor.engine_events import check_engine_events, hashing_by_design
from kvctl.core.doctor.events import check_event_plane, check_silent, check_streams
from kvctl.core.doctor.findings import (
    SHOWN,
    Finding,
    Limits,
    PeerDiff,
    Severity,
    first_id,
    named,
    stream_name,
    worker_name,
    worst,
    worst_first,
)
from kvctl.core.doctor.health import check_health
from kvctl.core.events.model_card import disaggregated_roles
from kvctl.core.names import DEFAULT_MODEL
from kvctl.core.router.busy import THRESHOLD_FIELDS, BusyTracker, Thresholds, WorkerLoad
from kvctl.core.words import counted

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
    roles: dict[str, Counter[str]] = {}
    for row in workers:
        if row.get("role"):
            roles.setdefault(row["model"], Counter())[row["role"]] += 1
    split = {model: counts for model, counts in roles.items() if counts["prefill"] and counts["decode"]}
    caveat = "".join(f"; model {model!r}: disaggregated fleet: by their model cards this model has "
                     f"{disaggregated_roles(counts)}, routed as two pools" for model, counts in split.items())
    return [Finding("workers", Severity.OK, f"{counted(len(workers), 'worker')} registered{caveat}",
                    {"workers_by_model": by_model, **({"disaggregated": {m: dict(c) for m, c in split.items()}}
                                                      if split else {})})]


# ----- 4. block size -----------------------------------------------------------------------------------------

def check_block_size(status: Mapping[str, Any], workers: Sequence[Mapping[str, Any]]) -> list[Finding]:
    model_of = {worker_name(w): w["model"] for w in workers}
    models = status.get("models", {})
    wrong: dict[str, dict[str, Any]] = {}
    for s in status.get("streams") or []:
        name = stream_name(s)
        expected = models.get(model_of.get(name, DEFAULT_MODEL), {}).get("block_size")
        seen = [b for b in s.get("schema", {}).get("block_sizes", []) if b != expected]
        if expected is not None and seen:
            wrong[name] = {"engine": sorted(s["schema"]["block_sizes"]), "router": expected}
    plane = status.get("event_plane") or {}
    cards = _cards_against_the_index(plane, models) if plane.get("model_cards") else []
    if not wrong:
        return cards or [Finding("block_size", Severity.OK, "engines' block sizes match their models'")]
    names = list(wrong)
    first = wrong[names[0]]
    return [Finding(
        "block_size", Severity.CRITICAL,
        f"block size mismatch: worker {names[0]} publishes {first['engine']}-token blocks, its model uses "
        f"{first['router']}: its blocks never match a request, so its overlap is always zero",
        {**named(names), "block_sizes": {n: wrong[n] for n in names[:SHOWN]}},
        f"set the router's --block-size (or the model's block_size) to the engine's {first['engine'][0]}, "
        "or the engine's to the router's")]


def _cards_against_the_index(plane: Mapping[str, Any], models: Mapping[str, Any]) -> list[Finding]:
    """A discovery-fed plane indexes each worker in the model its card names, as Dynamo's router does, and hashes
    prompts at that model's block size. One that differs from the cards' (kv_cache_block_size) hashes no prompt as
    the engines do: every overlap is 0 while the index still fills."""
    named_models = plane["model_cards"].get("models") or {}
    if not named_models:
        return []
    ours = {name: (models.get(name) or {}).get("block_size") for name in named_models}
    evidence = {"router_block_sizes": ours, "cards": {name: row.get("block_sizes") for name, row in
                                                      named_models.items()}}
    wrong = {name: row["block_sizes"] for name, row in named_models.items()
             if ours[name] is not None and any(b != ours[name] for b in row.get("block_sizes") or [])}
    if wrong:
        name, sizes = next(iter(wrong.items()))
        return [Finding(
            "block_size", Severity.CRITICAL,
            f"the fleet's model cards give model {name!r} {sizes[0]}-token blocks (kv_cache_block_size); this router "
            f"hashes it with {ours[name]}: no prompt hashes as the engines' blocks do, so every overlap is 0 while "
            "the index still fills", evidence,
            f"restart kvctl serve with --block-size {sizes[0]}")]
    shown = ", ".join(f"model {name!r} at {ours[name]}" for name in named_models)
    return [Finding("block_size", Severity.OK, f"block sizes match the fleet's model cards: {shown}", evidence)]


def check_hit_rates(engines: Mapping[str, float], predicted: float | None, *, zero: float = 0.05,
                    high: float = 0.3, gap: float = 0.3, predicted_by: str | None = None) -> list[Finding]:
    """Engines' own prefix-cache hit rates against the router's predicted hit rate (both since start).

    An engine's hit rate is its prefix cache's (vLLM, SGLang, a Dynamo worker's gauge) or, for engines that
    export none (Dynamo's mocker), the share of prompt tokens they reported cached to a Dynamo frontend.
    `predicted_by` names the metric the prediction came from (kvctl's router, or Dynamo's).
    Engines that find their prefixes cached while the router predicts no overlap means the router's
    blocks never match the engines' (block size, hash seed, LoRA or salt): it routes blind. Short of that, a
    `gap` either way is still a router that does not see the caches it routes on (issue 38: "predicts 39 %,
    engines hit 67 %" read OK)."""
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
    who = f"the router ({predicted_by})" if predicted_by else "the router"
    if mean - predicted > gap:
        return [Finding(
            "hit_rate", Severity.WARNING,
            f"{who} predicts {predicted:.0%} cache hits, engines hit {mean:.0%}: the engines find cache the router "
            "does not see (a host or disk tier they publish no events for, events lost, or requests routed by "
            "another router)", evidence, "kvctl tiers --metrics URL; kvctl doctor's streams and event_plane findings")]
    if predicted - mean > gap:
        return [Finding(
            "hit_rate", Severity.WARNING,
            f"{who} predicts {predicted:.0%} cache hits, engines hit {mean:.0%}: the router holds blocks the engines "
            "no longer have (evictions it missed: lost events, or a worker that restarted)", evidence,
            "kvctl router status (lost batches, restarts); kvctl tree diff ROUTER dynamo+http://INDEXER")]
    return [Finding("hit_rate", Severity.OK,
                    f"router predicts {predicted:.0%} hits, engines hit {mean:.0%}", evidence)]


# ----- 5. engine hashing ---------------------------------------------------------------------------------------

def check_hashing(workers: Sequence[Mapping[str, Any]], status: Mapping[str, Any] | None = None) -> list[Finding]:
    designed = hashing_by_design(status or {})
    explained = [(worker_name(w), w["hash_mismatches"]) for w in workers
                 if w.get("hash_mismatches") and worker_name(w) in designed]
    workers = [w for w in workers if worker_name(w) not in designed]
    mismatched = [(worker_name(w), w["hash_mismatches"]) for w in workers if w.get("hash_mismatches")]
    missing = [(worker_name(w), w.get("rejected_events", {}).get("block_not_found", 0)) for w in workers
               if w.get("rejected_events", {}).get("block_not_found")]
    if mismatched:
        odd = odd_hashers(workers)
        names = odd or [n for n, _ in mismatched]
        evidence = {**named(names), "mismatched_blocks": dict(mismatched[:SHOWN]),
                    "agreeing_blocks": {worker_name(w): w.get("hash_agreements", 0) for w in workers[:SHOWN]},
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
                evidence, f"worker {first_id(odd)}'s engine: the other engines' hash seed and block size; {fix}")]
        return [Finding(
            "hashing", Severity.CRITICAL,
            f"non-deterministic engine hashing: {counted(len(names), 'worker')} stored known token paths under other "
            "block hashes (Dynamo's \"block_hash mismatch\"), so their removals miss and prefixes are not shared",
            evidence, fix)]
    if explained:
        names = [n for n, _ in explained]
        return [Finding(
            "hashing", Severity.WARNING,
            f"{counted(len(names), 'worker')} stored known token paths under other block hashes by their engines' "
            "configuration, not by chance: their hashes and token blocks do not pair one to one. kvctl indexes "
            "them as Dynamo does, so prefixes they share with other engines count apart",
            {**named(names), "mismatched_blocks": dict(explained[:SHOWN]),
             "why": {n: designed[n] for n in names[:SHOWN]}},
            f"expected with speculative decoding's lookahead hashing; give worker {first_id(names)} the same "
            "configuration as the rest of its model to share their prefixes")]
    if missing:
        return [Finding(
            "hashing", Severity.WARNING,
            f"{counted(len(missing), 'worker')} removed blocks the router never saw stored: events were lost or "
            "the engine's hashes changed",
            {**named([n for n, _ in missing]), "removals_not_found": dict(missing[:SHOWN])},
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
            odd += [worker_name(w) for w in standing]
    return odd


def check_partial(workers: Sequence[Mapping[str, Any]]) -> list[Finding]:
    """A worker whose stores name parents the router never saw joined mid-stream (the router started after
    its engine, with no replay) or lost events: what hangs below those parents is missing from the index."""
    orphans = [(worker_name(w), w.get("rejected_events", {}).get("parent_block_not_found", 0)) for w in workers
               if w.get("rejected_events", {}).get("parent_block_not_found")]
    if not orphans:
        return []
    names = [n for n, _ in orphans]
    return [Finding(
        "partial", Severity.WARNING,
        f"{counted(len(orphans), 'worker')} stored blocks under parents the router never saw: it joined their streams "
        "mid-way (or lost events), so its index holds only part of what they cache and routes them too few hits",
        {**named(names), "rejected_for_unknown_parent": dict(orphans[:SHOWN])},
        f"register the engine's replay endpoint (kvctl serve --worker {first_id(names)}=tcp://…,replay=tcp://…), or "
        "accept the gap until those prefixes are evicted and stored again; kvctl workers -o wide")]


def check_recovery(status: Mapping[str, Any]) -> list[Finding]:
    """A worker found late on the ZMQ plane (no history) whose index could not be recovered over Dynamo's
    request plane is followed from its live events only: what it stored before is missing from the index."""
    rows = (status.get("event_plane") or {}).get("workers") or []
    failed = [(worker_name(r), r["recovery"].get("reason")) for r in rows
              if (r.get("recovery") or {}).get("state") == "partial"]
    if not failed:
        return []
    names = [n for n, _ in failed]
    return [Finding(
        "partial", Severity.WARNING,
        f"{counted(len(failed), 'worker')} could not be recovered over Dynamo's request plane: the router follows "
        "their "
        "live events only, so its index lacks what they stored before it found them",
        {**named(names), "reasons": dict(failed[:SHOWN])},
        "make each worker's recovery_target (v1/event_sources) reachable from kvctl, and kvctl's listener from "
        "the worker, then restart kvctl serve; or accept the gap until those prefixes are stored again")]


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
            full = [(worker_name(w), share) for w in rows if (share := _kv_share(w)) is not None
                    and share >= limits.kv_full_share]
            if full:
                findings.append(Finding(
                    "busy", Severity.WARNING,
                    f"{counted(len(full), 'worker')} of {model!r} using over {limits.kv_full_share:.0%} of their "
                    "KV cache "
                    "and no busy threshold is set: the router keeps sending them work",
                    {**named([n for n, _ in full]), "kv_share": dict(full[:SHOWN])},
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
        tripped[worker_name(w)] = [str(r) for r in reasons]
        for reason in reasons:
            signals[reason.signal.value] = signals.get(reason.signal.value, 0) + 1
    names = [worker_name(w) for w in busy]
    evidence = {"thresholds": dict(thresholds), "tripped_by": signals, **named(names),
                "tripped": {n: tripped[n] for n in names[:SHOWN]},
                "loads": {worker_name(w): {"active_decode_blocks": w.get("active_decode_blocks"),
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


# ----- 9. the router's loop -----------------------------------------------------------------------------------

def check_loop(status: Mapping[str, Any], limits: Limits, *, held: bool = False) -> list[Finding]:
    """The share of the last minute the router's loop was held past its 10 ms promise: every route and event
    arriving then waited behind the stall. A share, not a quantile of the loop-lag histogram, where a 0.5 s
    stall is one late probe among thousands. A router too old to report it gets no finding.

    With hysteresis, so that a share about the limit does not flap between OK and WARNING: a minute over
    `loop_blocked_share` warns when it held at least `loop_min_stalls` stalls (a one-off pause is not a held loop)
    or `loop_alone_share`; a loop already held warns until its minute falls under `loop_clear_share`. Held means
    the previous round warned (`held`: `doctor --watch` remembers) or, for a check with no memory of its own, the
    router's whole life (its share since start, over a minute at least) was over `loop_blocked_share`."""
    loop = status.get("loop")
    if loop is None:
        return []
    share, window = loop["window_blocked_share"], loop["window_s"]
    life = loop["blocked_s"] / max(status.get("uptime_s") or 0.0, window, 1e-9)
    held = held or life >= limits.loop_blocked_share
    evidence = {**{k: loop[k] for k in ("window_s", "window_blocked_share", "window_stalls", "window_longest_s",
                                        "blocked_s", "tolerance_s")}, "life_blocked_share": round(life, 4),
                "held": held}
    if held:
        warn = share >= limits.loop_clear_share
    else:
        warn = share >= limits.loop_blocked_share and (loop["window_stalls"] >= limits.loop_min_stalls
                                                        or share >= limits.loop_alone_share)
    if not warn:
        return [Finding("loop", Severity.OK, f"the router's loop was held {share:.1%} of the last {window:.0f} s",
                        evidence)]
    return [Finding(
        "loop", Severity.WARNING,
        f"the router's loop was held {share:.1%} of the last {window:.0f} s "
        f"({counted(loop['window_stalls'], 'stall')}, the longest {loop['window_longest_s'] * 1e3:.0f} ms past "
        f"{loop['tolerance_s'] * 1e3:.0f} ms; {life:.1%} since it started): every route and event arriving then "
        "waited behind it",
        evidence, "kvctl top --once  (ingest rate? a tree dump or stats, a snapshot, a bulk POST /v1/events, a "
                  "starved host?); the runbook's loop-lag")]


# ----- 10. a restart restoring its index ----------------------------------------------------------------------

def check_restoring(status: Mapping[str, Any]) -> list[Finding]:
    """A router whose restart is still restoring its index (`/readyz` 503): it refuses routes until the index is
    whole, and every count of it is partial, so this finding comes alone."""
    readiness = status.get("readiness")
    if not readiness or readiness.get("status") != "restoring":
        return []
    return [Finding(
        "restore", Severity.WARNING,
        f"the router is restoring its index ({readiness['phase']}, {readiness['percent']:g}% after "
        f"{readiness['elapsed_s']:g} s): routes, dumps and event loads are refused (503) until it is whole",
        dict(readiness), "wait for GET /readyz to answer 200, then run kvctl doctor again")]


def diagnose(status: Mapping[str, Any], workers: Sequence[Mapping[str, Any]],
             thresholds: Sequence[Mapping[str, Any]], peers: Sequence[PeerDiff] = (),
             limits: Limits | None = None, hit_rates: list[Finding] | None = None,
             previous: Sequence[Finding] = (), routing: Sequence[Finding] = ()) -> list[Finding]:
    """Every check, worst first; registration problems make the rest moot, so they come alone.
    `hit_rates`: `check_hit_rates`' finding, when engines' metrics were read. `previous`: the last round's
    findings, for the checks with hysteresis (`doctor --watch`). `routing`: the decision audit's."""
    limits = limits or Limits()
    loop_held = any(f.check == "loop" and f.severity is Severity.WARNING for f in previous)
    restoring = check_restoring(status)
    if restoring:
        return restoring
    registration = check_registration(status, workers)
    plane = check_event_plane(status, workers, limits)
    if worst(registration) is Severity.CRITICAL:
        return worst_first([*registration, *plane, *check_health(status, limits)])  # the plane may say why
    findings = [*registration, *check_silent(status, workers, limits), *check_streams(status), *plane,
                *check_engine_events(status),
                *check_block_size(status, workers), *check_hashing(workers, status), *check_partial(workers),
                *check_recovery(status),
                *check_busy(workers, thresholds, limits), *check_divergence(peers, limits),
                *check_index(status, limits), *check_loop(status, limits, held=loop_held),
                *check_health(status, limits), *(hit_rates or []), *routing]
    return worst_first(findings)
