"""Doctor's checks of the event flow: workers gone silent, streams with gaps, replays, restarts or decode
errors, and Dynamo's NATS event plane. They share the taps (`kvctl events tail`) that show the flow itself."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from typing import Any

from kvctl.core.doctor.engine_events import undeclared_ranks
from kvctl.core.doctor.findings import (
    SHOWN,
    Finding,
    Limits,
    Severity,
    first_id,
    named,
    stream_name,
    worker_name,
)
from kvctl.core.silence import is_silent
from kvctl.core.words import counted

# ----- 2. silent workers ----------------------------------------------------------------------------------

def check_silent(status: Mapping[str, Any], workers: Sequence[Mapping[str, Any]], limits: Limits, *,
                 scope: str = "every worker") -> list[Finding]:
    """Silence alone may be an idle fleet: an engine publishes events only when its cache changes. It is a
    fault for sure when the worker serves regardless: routes won with no event ever, requests in flight
    now, or messages arriving that deliver no event. CRITICAL only when every worker is silent and some
    are known to be serving: the router routes blind (Dynamo #4249: engines not emitting KV events).
    A silent worker that serves nothing while no worker of its model publishes either is idle: OK, so that a
    quiet night pages nobody; one whose model's other workers publish stays a WARNING (why is it left out?).
    `scope` names the workers when some were judged apart (orphans of a restore)."""
    approximate = {m for m, stats in (status.get("models") or {}).items() if stats.get("approximate")}
    workers = [w for w in workers if w["model"] not in approximate]  # they publish no events, by design
    if not workers:
        return [Finding("silent", Severity.OK, "approximate mode: the router indexes its own routes, not events")]
    by_design = [worker_name(w) for w in workers if w.get("publishes_kv_events") is False]
    if by_design:  # their model cards say so: a disaggregated fleet's decode workers
        designed = set(by_design)
        rest = [w for w in workers if worker_name(w) not in designed]
        finding = Finding("silent", Severity.OK, f"{len(by_design)} of {counted(len(workers), 'worker')} publish no "
                        "KV events by their model cards (a disaggregated fleet's decode workers): silent by design",
                        named(by_design))
        return [finding, *(check_silent(status, rest, limits, scope=f"the other {counted(len(rest), 'worker')}")
                         if rest else [])]
    quiet = [w for w in workers if is_silent(w.get("last_event_age_s"), limits.silent_after_s)]
    misranked = undeclared_ranks(status)
    if any(worker_name(w) in misranked for w in quiet):
        rest = [w for w in workers if worker_name(w) not in misranked]
        others = f"the other {counted(len(rest), 'worker')}"
        return [_misranked(misranked), *(check_silent(status, rest, limits, scope=others) if rest else [])]
    orphans = _orphans(status, quiet)
    if orphans:
        gone = {id(w) for w in orphans}
        rest = [w for w in workers if id(w) not in gone]
        others = f"the other {counted(len(rest), 'worker')}"
        return [_orphaned(orphans, len(workers)), *(check_silent(status, rest, limits, scope=others) if rest else [])]
    if not quiet:
        return [Finding("silent", Severity.OK, f"{scope} sent events in the last {limits.silent_after_s:g} s")]
    serving = _serving_while_silent(status, quiet, limits)
    quiet_names = {worker_name(w) for w in quiet}
    publishing = {w["model"] for w in workers if worker_name(w) not in quiet_names}
    idle = [worker_name(w) for w in quiet if worker_name(w) not in serving and w["model"] not in publishing]
    if len(idle) == len(quiet):
        return [Finding("silent", Severity.OK,
                        f"{len(idle)} of {len(workers)} workers silent for over {limits.silent_after_s:g} s, none "
                        "serving and no worker of their models publishing: an idle fleet", named(idle))]
    resting = set(idle)
    silent = [w for w in quiet if worker_name(w) not in resting]
    never = [worker_name(w) for w in silent if w.get("last_event_age_s") is None]
    stale = [(worker_name(w), w["last_event_age_s"]) for w in silent if w.get("last_event_age_s") is not None]
    severity = Severity.CRITICAL if len(quiet) == len(workers) and serving else Severity.WARNING
    cause = (f"{len(silent)} of {len(workers)} workers silent: "
             + ", ".join(filter(None, [f"{len(never)} never sent an event" if never else "",
                                       f"{len(stale)} quiet for over {limits.silent_after_s:g} s" if stale else "",
                                       f"{len(serving)} of them serving regardless" if serving
                                       else "none known to be serving (idle, or not publishing?)"])))
    names = [worker_name(w) for w in silent]
    evidence = {**named(names), "never": never[:SHOWN], "quiet_s": dict(stale[:SHOWN]),
                "serving": dict(list(serving.items())[:SHOWN]), "idle": idle[:SHOWN]}
    return [Finding("silent", severity, cause, evidence,
                    f"{_tap(silent[0], status)}  (is worker {first_id(names)} publishing at all? check the "
                    "engine's kv-events config and the endpoint registered)")]


def _misranked(misranked: Mapping[str, list[int]]) -> Finding:
    """Engines registered under one DP rank that publish under others: their events are indexed under the ranks
    they name (as Dynamo does), and the registered rank is quiet; not silent."""
    names = list(misranked)
    return Finding(
        "silent", Severity.WARNING,
        f"{counted(len(names), 'worker')} publish under DP ranks they were not registered with, so the registered "
        "rank stays empty while the events are indexed under the ranks they name",
        {**named(names), "ranks_published": {n: misranked[n] for n in names[:SHOWN]}},
        f"register each rank with its own endpoint (serve --worker {first_id(names)}:RANK=…), as the engine "
        "publishes them")


def _orphans(status: Mapping[str, Any], quiet: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Restored workers that nothing this router follows can speak for: with engine streams or an event plane,
    a worker known only from the state dir, with no stream and no publisher, is another fleet's or a gone
    engine's. Its blocks win routes on stale data, so it is never an idle fleet. An HTTP-fed router cannot
    tell (its events come by POST), so there silence rules alone apply."""
    if not status.get("streams") and status.get("event_plane") is None:
        return []
    return [w for w in quiet if w.get("restored") and not w.get("endpoint") and not w.get("event_plane")]


def _orphaned(orphans: Sequence[Mapping[str, Any]], known: int) -> Finding:
    names = [worker_name(w) for w in orphans]
    blocks = sum(w.get("blocks") or 0 for w in orphans)
    models = sorted({str(w["model"]) for w in orphans})
    return Finding(
        "silent", Severity.WARNING,
        f"{len(orphans)} of {known} workers known only from the state dir: no engine stream or event-plane "
        f"publisher of this router names them and nothing came from them since it started; their "
        f"{counted(blocks, 'block')} are stale (an earlier configuration's fleet, or engines that are gone)",
        {**named(names), "blocks": blocks, "models": models},
        f"kvctl router reset --worker {first_id(names)} --yes  (forget them; or serve the configuration that "
        "follows them)")


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
    streams = {stream_name(s): s for s in status.get("streams") or []}
    out: dict[str, dict[str, Any]] = {}
    for w in silent:
        name, stream = worker_name(w), streams.get(worker_name(w), {})
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
    lost = [(stream_name(s), s) for s in streams
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
            {**named(names), "lost_batches": {n: s.get("lost_batches", 0) for n, s in lost[:SHOWN]},
             "gaps": {n: s.get("gaps", 0) for n, s in lost[:SHOWN]},
             "replays_failed": {n: s.get("replays_failed", 0) for n, s in lost[:SHOWN]},
             "replay_endpoint": {n: s.get("replay_endpoint") for n, s in lost[:SHOWN]}},
            f"kvctl router reset --worker {first_id(names)} --yes  (resync it); then {fix}"))
    restarted = [(stream_name(s), s["restarts"]) for s in streams if s.get("restarts")]
    if restarted:
        findings.append(Finding(
            "restarts", Severity.WARNING,
            f"{counted(len(restarted), 'engine')} restarted; each restart cleared the worker",
            {**named([n for n, _ in restarted]), "restarts": dict(restarted[:SHOWN])},
            "check the engines' logs for crashes or OOM kills; kvctl router status"))
    broken = [(stream_name(s), s) for s in streams if s.get("decode_errors")]
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
    failed = [(stream_name(s), s) for s in streams if s.get("failures")]
    if not failed:
        return []
    down = [n for n, s in failed if s.get("state") == "failed"]
    names = down or [n for n, _ in failed]
    cause = (f"{counted(len(down), 'engine stream')} failed, not reading their engines' events (retried with "
             "backoff)" if down else f"{counted(len(failed), 'engine stream')} failed and ran again")
    return [Finding(
        "streams", Severity.CRITICAL if down else Severity.WARNING, cause,
        {**named(names), "last_error": {n: s.get("last_error") for n, s in failed[:SHOWN]},
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



# ----- the Dynamo event plane (NATS) ----------------------------------------------------------------------

KEYED_AFTER = 8
"""Peers' ended requests whose first hash was in no worker's index before doctor calls their hashes keyed: one or
two can have lost their first block to an eviction."""


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
    tracking = (plane.get("peers") or {}).get("tracking") or {}
    if tracking.get("checked", 0) >= KEYED_AFTER and not tracking.get("matched"):
        findings.append(Finding(
            "event_plane", Severity.WARNING,
            f"none of the {counted(tracking['checked'], 'peer request')} that ended was tracked by a hash the index "
            "holds: the frontend tracks in-flight requests by keyed hashes (--router-tracking-hash keyed-xxh3-v1), "
            "and this router prices the prefixes they share as new decode load",
            {"tracking": tracking},
            "restart kvctl serve with the frontend's --router-tracking-hash keyed-xxh3-v1 "
            "--router-tracking-key-file FILE --router-tracking-key-id ID"))
    bindings, modes = (plane.get("counts") or {}).get("session_bindings", 0), status.get("modes")
    if bindings and modes is not None and not modes.get("session_affinity"):
        findings.append(Finding(
            "event_plane", Severity.WARNING,
            f"the fleet's frontend pins sessions ({counted(bindings, 'binding')} heard on session_affinity_events) "
            "and this router has session affinity off: its picks for a session are not the frontend's",
            {"session_bindings": bindings},
            "restart kvctl serve with the frontend's --router-session-affinity-ttl-secs"))
    stopped = [(worker_name(w), w["forward_pass"]["age_s"]) for w in workers
               if (w.get("forward_pass") or {}).get("age_s", 0) > limits.silent_after_s]
    if stopped:
        findings.append(Finding(
            "event_plane", Severity.WARNING,
            f"{counted(len(stopped), 'worker')} stopped reporting forward passes (every Dynamo worker reports each "
            f"pass, idle or not): stopped, hung or cut off for over {limits.silent_after_s:g} s",
            {**named([n for n, _ in stopped]), "last_report_s": dict(stopped[:SHOWN])},
            "is the worker process alive? kvctl workers -o wide; once it is gone for good: "
            f"kvctl router reset --worker {first_id([n for n, _ in stopped])} --yes"))
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
