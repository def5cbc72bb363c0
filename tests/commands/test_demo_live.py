"""The demo's live summary (what a terminal sees): one row per phase, redrawn in place."""

from __future__ import annotations

import io

from kvctl.commands.demo import _LiveSummary, _progress
from kvctl.mock.load import LoadStats, Policy
from kvctl.output import Output


def test_live_summary_shows_each_phase_once_with_its_hit_rate() -> None:
    err = io.StringIO()
    baseline, routed = LoadStats(Policy.random), LoadStats(Policy.router)
    baseline.prompt_tokens, baseline.cached_tokens, baseline.completed = 1000, 300, 10
    routed.prompt_tokens, routed.cached_tokens, routed.completed = 1000, 750, 12
    with _LiveSummary(Output(stderr=err, color=False)) as live:
        live.update("open loop random", baseline)
        live.update("open loop router", routed)
        routed.completed = 20
        live.update("open loop router", routed)
    final = err.getvalue().split("kvctl demo:")[-1]
    assert "30.0%" in final and "75.0%" in final
    assert final.count("open loop router") == 1 and " 20 " in final


def test_before_the_first_answer_the_progress_shows_a_dash_never_none() -> None:
    err = io.StringIO()
    out = Output(stderr=err, color=False)
    _progress(out, "capacity random", LoadStats(Policy.random))
    with _LiveSummary(out) as live:
        live.update("capacity router", LoadStats(Policy.router))
    assert "None" not in err.getvalue()
    assert "ttft p90 - ms" in err.getvalue()
