"""The runbook's section anchors are a promise: alerts (issue 25) link to them, so each symptom's anchor must stay
exactly as published, on a section of its own."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "runbook.md"
ANCHORS = ("overlap-always-0", "predicted-hits-not-real", "all-busy", "replicas-disagree", "events-stopped",
           "engine-restarted", "decode-errors", "loop-lag", "index-near-cap", "restoring",
           "kvctl-blind", "routing-misses-cache")


def test_every_published_anchor_opens_a_section() -> None:
    opened = re.findall(r'^<a id="([^"]+)"></a>\n## ', DOC.read_text(), re.M)
    assert sorted(opened) == sorted(ANCHORS), f"anchors before a `## ` heading: {opened}"
