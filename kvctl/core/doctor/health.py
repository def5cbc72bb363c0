"""Doctor's reading of the router's own ledger (`/v1/status` `health`): the parts of kvctl that are down, and the
inputs it refused or lost, so that kvctl being blind or partial is a finding, never an OK (issue 36)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvctl.core.doctor.findings import Finding, Limits, Severity
from kvctl.core.words import counted


def check_health(status: Mapping[str, Any], limits: Limits) -> list[Finding]:
    """A fault that blocks readiness is CRITICAL, any other (a partial index) a WARNING; losses are a WARNING while
    the last one is under `limits.recent_loss_s` old, so that one bad night does not page for a week."""
    ledger = status.get("health")
    if not ledger:
        return []
    findings = [Finding(f"part:{f['part']}", Severity.CRITICAL if f["blocks_ready"] else Severity.WARNING,
                        f"{f['part']}: {f['reason']} (for {f['for_s']:g} s)", dict(f), f["fix"])
                for f in ledger["faults"]]
    for loss in ledger["losses"]:
        recent = loss["last_s_ago"] < limits.recent_loss_s
        what = (f"{loss['surface']}: {counted(loss['count'], 'input')} refused or lost ({loss['cause']}), "
                f"the last {loss['last_s_ago']:g} s ago")
        findings.append(Finding(f"lost:{loss['surface']}", Severity.WARNING if recent else Severity.OK,
                                f"{what}: {loss['detail']}" if loss["detail"] else what, dict(loss),
                                loss["fix"] if recent else ""))
    return findings
