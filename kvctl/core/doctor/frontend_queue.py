"""A Dynamo frontend's router queue, read from its metrics (`doctor --metrics` or `--prometheus`, `route
--metrics`): a frontend with `--router-queue-threshold` (or policy classes) holds requests while every eligible
worker is past it, and rejects past its caps. kvctl serve holds no request, so without this a queueing fleet read
as idle workers and an OK doctor; and a route's verdict could not say how many wait ahead of it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from kvctl.core.doctor.findings import Finding, Severity
from kvctl.core.tiers import DYNAMO_QUEUE_PENDING, DYNAMO_QUEUE_REFUSED, Sample, Window
from kvctl.core.words import counted


def pending_in_class(samples: Iterable[Sample], model: str, policy_class: str, worker_type: str) -> int | None:
    """Requests the frontend holds now in one class of a model's pool (`worker_type`: prefill, or decode for
    the aggregated and decode pools, as its metrics label them); None when it exports no queue for that class
    (its series are there while idle, at 0: a missing one is another model or class, not an empty queue)."""
    wanted = (model, policy_class, worker_type)
    found = [int(s.value) for s in samples if DYNAMO_QUEUE_PENDING.pattern.fullmatch(s.name)
             and (s.labels.get("model"), s.labels.get("policy_class"), s.labels.get("worker_type")) == wanted]
    return sum(found) if found else None


def queue_note(windows: Sequence[Window]) -> str | None:
    """What `kvctl top` says of the frontends among its metrics whose router queue holds requests now; None when
    none does (or none exports one)."""
    waiting: Counter[str] = Counter()
    for window in windows:
        for sample in window.samples:
            if DYNAMO_QUEUE_PENDING.pattern.fullmatch(sample.name):
                waiting[window.instance] += int(sample.value)
    held = {instance: n for instance, n in sorted(waiting.items()) if n > 0}
    return ("router queue: " + ", ".join(f"{counted(n, 'request')} waiting at {instance}"
                                         for instance, n in held.items())) if held else None


def check_frontend_queue(windows: Sequence[Window]) -> list[Finding]:
    """Requests pending in any frontend's router queue now, and those its queue refused over the window; no
    finding when no frontend among the metrics has a router queue."""
    pending: Counter[tuple[str, str, str, str]] = Counter()
    refused: Counter[tuple[str, str]] = Counter()
    found = False
    for window in windows:
        for sample in window.samples:
            if DYNAMO_QUEUE_PENDING.pattern.fullmatch(sample.name):
                found = True
                labels = sample.labels
                pending[(window.instance, labels.get("model", "?"), labels.get("policy_class", "?"),
                         labels.get("worker_type", "?"))] += int(sample.value)
            elif DYNAMO_QUEUE_REFUSED.pattern.fullmatch(sample.name):
                found = True
                refused[(window.instance, sample.labels.get("reason", "?"))] += int(sample.value)
    if not found:
        return []
    findings = []
    queued = {key: n for key, n in pending.items() if n > 0}
    if queued:
        (instance, model, policy, role), n = max(queued.items(), key=lambda kv: kv[1])
        findings.append(Finding(
            "frontend_queue", Severity.WARNING,
            f"the Dynamo frontend at {instance} holds {counted(sum(queued.values()), 'request')} in its router "
            f"queue ({n} of model {model!r}, policy class {policy!r}, worker type {role!r}): every eligible worker is "
            "past the queue threshold; kvctl serve holds no request (its routes say `queued` when given the "
            "frontend's queue flags or policy file)",
            {"pending": {"/".join(key): value for key, value in queued.items()}},
            f"kvctl busy get --server http://{instance}; add capacity, or raise the frontend's queue threshold"))
    rejected = {key: n for key, n in refused.items() if n > 0}
    if rejected:
        (instance, reason), n = max(rejected.items(), key=lambda kv: kv[1])
        findings.append(Finding(
            "frontend_queue", Severity.WARNING,
            f"the Dynamo frontend at {instance} refused {counted(sum(rejected.values()), 'request')} at its router "
            f"queue's caps ({n} for {reason})", {"refused": {"/".join(key): value for key, value in rejected.items()}},
            "the queue caps of the frontend's --router-policy-config"))
    return findings or [Finding("frontend_queue", Severity.OK, "no request waits in a Dynamo frontend's router queue")]
