"""How a frame reads as text: the cells (and the audit line's fields) both the dashboard and `kvctl top --once`
show, and the output sink's views for `--once` (json/yaml print `Frame.to_dict()` instead)."""

from __future__ import annotations

from typing import Any

from kvctl.core.doctor.routing_audit import MIN_DECISIONS, OPTIMAL_FLOOR
from kvctl.core.words import counted
from kvctl.output import Column, Output, OutputFormat, View
from kvctl.output.words import age
from kvctl.tui.frame import Frame, Header, RoutingAudit, StreamHealth, WorkerRow

WORKER_COLUMNS = (
    Column("worker", "name"),
    Column("model", "model"),
    Column("blocks", "blocks", justify="right"),
    Column("decode blk", "active_decode_blocks", justify="right"),
    Column("prefill tok", "active_prefill_tokens", justify="right"),
    Column("busy", "busy"),
    Column("last event", "last_event", justify="right"),
    Column("gaps", "gaps", justify="right"),
    Column("decode err", "decode_errors", justify="right"),
    Column("routes", "route_share", justify="right"),
    Column("queued", "queued", justify="right"),
    Column("marks", "marks"),
)
"""The workers table's columns, in the dashboard and in `--once` alike."""


def count(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def per_second(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 1000:
        return f"{value / 1000:.1f}k"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def size(n: int | None) -> str:
    if n is None:
        return "-"
    unit, scale = next((u, s) for u, s in _UNITS if n >= s or s == 1)
    return f"{n} B" if scale == 1 else f"{n / scale:.1f} {unit}"


def worker_cells(row: WorkerRow) -> dict[str, str]:
    """A worker row as the strings its cells show, by column key."""
    return {
        "name": row.key, "model": row.model if row.role in (None, "aggregated") else f"{row.model} ({row.role})",
        "blocks": count(row.blocks),
        "active_decode_blocks": count(row.active_decode_blocks),
        "active_prefill_tokens": count(row.active_prefill_tokens), "busy": "yes" if row.busy else "no",
        "last_event": age(row.last_event_age_s) or "never", "gaps": count(row.gaps),
        "decode_errors": count(row.decode_errors), "route_share": percent(row.route_share),
        "queued": count(row.queued), "marks": " ".join(row.marks) or "-",
    }


def header_fields(router: str, header: Header) -> dict[str, str]:
    """The header's fields; while a restart restores the index, "restoring" comes first: the counts are part."""
    restoring = {} if header.restoring is None else {"restoring": header.restoring}
    return {
        "router": router, "models": ", ".join(header.models) or "-", "uptime": age(header.uptime_s) or "-",
        **restoring, "events/s": per_second(header.events_per_s), "routes/s": per_second(header.routes_per_s),
        "blocks": count(header.blocks),
        "nodes": count(header.nodes), "rss": size(header.rss_bytes),
    }


def health_fields(health: StreamHealth) -> dict[str, str]:
    states = " · ".join(f"{state} {n}" for state, n in sorted(health.by_state.items()))
    fields = {
        "streams": f"{health.streams}: {states}" if health.streams else "none (events over HTTP or NATS)",
        "gaps": count(health.gaps), "lost batches": count(health.lost_batches),
        "failed replays": count(health.replays_failed), "restarts": count(health.restarts),
        "decode errors": count(health.decode_errors), "queue drops": count(health.dropped_batches),
    }
    if health.plane is not None:
        fields["event plane"] = plane_summary(health.plane)
    return fields


def plane_summary(plane: dict[str, Any]) -> str:
    """The event plane in one line: its state, its publishers and what their sequences lost (per publisher:
    kvctl router status -o wide)."""
    order = plane.get("sequence") or {}
    parts = [f"{plane.get('state')} (reconnects {plane.get('reconnects', 0)})",
             f"{counted(order.get('publishers', 0), 'publisher')}", f"gaps {count(order.get('gaps', 0))}",
             f"lost {count(order.get('lost', 0))}", f"restarts {count(order.get('restarts', 0))}"]
    links = plane.get("connections")
    if isinstance(links, list):  # Dynamo's ZMQ plane: a socket per publisher and topic
        parts.append(f"sockets {sum(1 for link in links if link.get('connected'))}/{len(links)}")
    return " · ".join(parts)


def audit_fields(audit: RoutingAudit) -> dict[str, str]:
    """The decision audit's window as the audit line's fields, the window's first: the share of decisions with
    cache to find that went to a worker holding the most, the avoidable prefill, kvctl's agreement and the top
    reasons for the rest; for an empty window, what it looked at (its first clause: `kvctl audit` says the rest)."""
    label = f"routing ({audit.window_s / 60:g} min)"
    if not audit.decisions:
        looked, _, _ = audit.looked_at.partition(": ")
        return {label: f"{looked}; kvctl audit says where it listens"}
    if audit.cached_decisions:
        share = "-" if audit.optimal_share is None else f"{audit.optimal_share:.0%}"
        said = (f"{share} of {_decisions(audit.cached_decisions)} with cache to find went to a worker holding "
                "the most")
    else:
        said = f"{_decisions(audit.decisions)}, none with cache to find"
    tokens = f"{audit.avoidable_prefill_tokens:,} tokens"
    fields = {label: said, "avoidable prefill": tokens if audit.avoidable_share is None
              else f"{audit.avoidable_share:.0%} ({tokens})"}
    if audit.agreement_share is not None:
        ties, others = audit.agreement.get("tie", 0), audit.agreement.get("disagree", 0)
        fields["kvctl agrees"] = (f"{audit.agreement_share:.0%} ({counted(ties, 'tie')}"
                                  + (f", {others:,} not" if others else "") + ")")
    if audit.reasons:
        fields["top reasons"] = ", ".join(f"{why} {n:,}" for why, n in list(audit.reasons.items())[:3])
    return fields


def _decisions(n: int) -> str:
    return f"{n:,} decision" + ("" if n == 1 else "s")


def audit_parts(audit: RoutingAudit) -> list[tuple[str, str]]:
    """The audit line's parts as (label, value), each label ending as the line reads it."""
    return [(f"{key}{': ' if not i or key == 'top reasons' else ' '}", value)
            for i, (key, value) in enumerate(audit_fields(audit).items())]


def audit_line(audit: RoutingAudit) -> str:
    """The audit line as one string: "routing (5 min): 83% of 46 decisions … · avoidable prefill 7% (…) · …"."""
    return " · ".join(label + value for label, value in audit_parts(audit))


def audit_is_poor(audit: RoutingAudit) -> bool:
    """Poor routing by doctor's rule: enough decisions with cache to find, too few of them to the most cache."""
    share = audit.optimal_share
    return audit.cached_decisions >= MIN_DECISIONS and share is not None and share < OPTIMAL_FLOOR


def _field_rows(fields: dict[str, str]) -> list[dict[str, Any]]:
    return [{"field": k, "value": v} for k, v in fields.items()]


_FIELD_COLUMNS = [Column("field", "field"), Column("value", "value")]
_WORKERS_VIEW = View(rows=lambda frame: [worker_cells(w) for w in frame.workers], columns=WORKER_COLUMNS,
                     name_key="name", title="workers")
_HEADER_VIEW = View(rows=lambda frame: _field_rows(header_fields(frame.router, frame.header)),
                    columns=_FIELD_COLUMNS, name_key="field", title="router")
_HEALTH_VIEW = View(rows=lambda frame: _field_rows(health_fields(frame.health)), columns=_FIELD_COLUMNS,
                    name_key="field", title="stream health")
_TIERS_VIEW = View(
    rows=lambda frame: [{"instance": t.instance, "tier": t.tier, "hit_rate": percent(t.hit_rate), "family": t.family}
                        for t in frame.tiers or ()],
    columns=[Column("instance", "instance"), Column("tier", "tier"), Column("hit rate", "hit_rate", justify="right"),
             Column("family", "family")],
    name_key="instance", title="tiers")
_AUDIT_VIEW = View(rows=lambda frame: _field_rows(audit_fields(frame.audit)), columns=_FIELD_COLUMNS,
                   name_key="field", title="routing audit")


def emit_frame(out: Output, frame: Frame) -> None:
    """One frame through the sink: json/yaml the frame object, `name` one worker a line, tables otherwise."""
    if out.format in (OutputFormat.json, OutputFormat.yaml):
        out.emit(frame.to_dict(), _WORKERS_VIEW)
        return
    if out.format is OutputFormat.name:
        out.emit(frame, _WORKERS_VIEW)
        return
    for view in (_HEADER_VIEW, _WORKERS_VIEW, _HEALTH_VIEW):
        out.emit(frame, view)
    if frame.audit is not None:
        out.emit(frame, _AUDIT_VIEW)
    elif frame.audit_note:
        out.note(f"routing audit: {frame.audit_note}")
    if frame.tiers_error:
        out.warn(f"tiers: {frame.tiers_error}")
    if frame.tiers is not None:
        out.emit(frame, _TIERS_VIEW)
    if frame.tiers_note:
        out.note(f"tiers: {frame.tiers_note}")
