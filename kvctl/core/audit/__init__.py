"""The decision audit: each routed decision judged against kvctl's index (docs/audit.md)."""

from kvctl.core.audit.ledger import AuditLedger, summarise
from kvctl.core.audit.verdict import Agreement, Outcome, Seen, Verdict, Why, judge

__all__ = ["Agreement", "AuditLedger", "Outcome", "Seen", "Verdict", "Why", "judge", "summarise"]
