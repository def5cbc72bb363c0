"""Doctor's findings as one monitoring check (`kvctl doctor -o nagios`): the worst finding's cause is the alert's
text, its next step the first long-output line, every other finding a line after it; perfdata counts findings by
severity and graphs the few numbers worth a graph (workers, silent workers, the loop's held share)."""

from __future__ import annotations

from collections.abc import Sequence

from kvctl.core.doctor.findings import Finding, Limits, Severity, worst, worst_first
from kvctl.core.nagios import Perf, plugin_output
from kvctl.core.words import counted


def doctor_check(findings: Sequence[Finding], limits: Limits) -> str:
    """The plugin's output for these findings (exit with `worst(findings)`)."""
    ordered = worst_first(findings)
    status = worst(findings)
    problems = [f for f in ordered if f.severity is not Severity.OK]
    if problems:
        first = problems[0]
        more = f" (+{len(problems) - 1} more: {', '.join(f.check for f in problems[1:])})" if problems[1:] else ""
        summary = f"{first.cause}{more}"
        details = [f"next: {first.next_step}"] if first.next_step else []
        rest = [f for f in ordered if f is not first]
    else:
        summary = f"no problem found ({counted(len(findings), 'check')} OK)"
        details, rest = [], ordered
    details += [f"{f.severity.name} {f.check}: {f.cause}" + (f" (next: {f.next_step})" if f.next_step and
                                                                f.severity is not Severity.OK else "")
                for f in rest]
    return plugin_output("doctor", status.name, summary, _perfdata(findings, limits), details)


def _perfdata(findings: Sequence[Finding], limits: Limits) -> list[Perf]:
    perf = [Perf(s.name.lower(), sum(f.severity is s for f in findings), min=0)
            for s in (Severity.CRITICAL, Severity.WARNING, Severity.UNKNOWN, Severity.OK)]
    by_check = {f.check: f for f in findings}
    registered = by_check.get("workers")
    if registered is not None and "workers_by_model" in registered.evidence:
        workers = sum(registered.evidence["workers_by_model"].values())
        perf.append(Perf("workers", workers, min=0))
        silent = by_check.get("silent")
        if silent is not None:
            perf.append(Perf("silent_workers", silent.evidence.get("count", 0), min=0, max=workers))
    loop = by_check.get("loop")
    if loop is not None:
        perf.append(Perf("loop_held", round(100 * loop.evidence["window_blocked_share"], 2), "%",
                         warn=100 * limits.loop_blocked_share, min=0, max=100))
    return perf
