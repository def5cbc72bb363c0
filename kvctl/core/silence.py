"""When a worker counts as silent: one rule for `kvctl doctor` and `kvctl top`, so they never disagree.

An engine publishes KV events only when its cache changes, so silence alone may be an idle fleet; the
limit is long enough that a fleet under any load does not trip it between two cache changes.
"""

from __future__ import annotations

SILENT_AFTER_S = 60.0
"""A worker with no event for this long (or none ever) is silent (`kvctl doctor --silent-after`)."""


def is_silent(last_event_age_s: float | None, after_s: float = SILENT_AFTER_S) -> bool:
    """No event ever, or none for `after_s` seconds or longer."""
    return last_event_age_s is None or last_event_age_s >= after_s
