"""`kvctl audit` against a real `kvctl serve` holding Dynamo 1.6.1's dump: its own routes, judged and shown."""

from __future__ import annotations

import json
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

from tests.commands.live_router import PROMPT, json_of, kvctl, loaded_router
from tests.fixtures_path import FIXTURES
from tests.tiers.exporter import metrics_handler

FRONTEND_METRICS = (FIXTURES / "dynamo-1.6.1-fleet" / "metrics" / "frontend.prom").read_bytes()
FRONTEND_ROUTER = "4238352712680185056"  # the router id its decision counters are labelled with


def test_an_empty_window_says_what_it_looked_at(tmp_path: Path) -> None:
    with loaded_router(tmp_path) as client:
        result = kvctl(client, "audit")
    assert result.exit_code == 0, result.output
    assert "no decision heard in the last 300 s (0 since start)" in result.stdout
    assert "--router-replica-sync" in result.stdout  # how to make a frontend's decisions heard


def test_routes_are_summarised_listed_explained_and_bad_input_refused(tmp_path: Path) -> None:
    with loaded_router(tmp_path) as client:
        for n in range(3):
            body = {"token_ids": PROMPT, "request_id": f"req-{n}"}
            assert client.post("/v1/route", json=body).status_code == 200
        summary = json_of(kvctl(client, "audit", "-o", "json"))
        table = kvctl(client, "audit")
        recent = kvctl(client, "audit", "--recent", "2")
        one = kvctl(client, "audit", "--request", "req-1")
        one_json = json_of(kvctl(client, "audit", "--request", "req-1", "-o", "json"))
        unknown = kvctl(client, "audit", "--request", "nope")
        bad_window = kvctl(client, "audit", "--window", "soon")
    assert (summary["decisions"], summary["cached_decisions"], summary["optimal_share"]) == (3, 3, 1.0)
    assert summary["routers"] == {"kvctl": 3} and summary["avoidable_prefill_tokens"] == 0
    assert "3 decisions, 3 with cache to find; 100% of those went to a worker holding the most" in \
        " ".join(table.stdout.split())  # the title wraps at the terminal's width
    assert table.stdout.count("\n") >= 3 and "AVOIDABLE TOKENS" in table.stdout
    assert [line.split()[0] for line in recent.stdout.splitlines() if line.startswith("req-")] == ["req-1", "req-2"]
    assert one.exit_code == 0 and "request req-1 (default, router kvctl" in " ".join(one.stdout.split())
    assert one_json["outcome"] == "optimal" and one_json["best_overlap"] == 4 and len(one_json["candidates"]) == 4
    assert unknown.exit_code == 1 and "no decision for request 'nope'" in unknown.output
    assert bad_window.exit_code == 2 and "--window" in bad_window.output
    assert json.loads(json.dumps(summary))  # plain JSON, stable for scripts


def test_what_if_reprices_the_window_and_refuses_a_bad_knob(tmp_path: Path) -> None:
    with loaded_router(tmp_path) as client:
        for n in range(3):
            assert client.post("/v1/route", json={"token_ids": PROMPT, "request_id": f"req-{n}"}).status_code == 200
        same = json_of(kvctl(client, "audit", "--what-if", "overlap_score_credit=1", "-o", "json"))["what_if"]
        table = kvctl(client, "audit", "--what-if", "overlap_score_credit=0")
        bad = kvctl(client, "audit", "--what-if", "overlap_score_credit=-1")
        unknown = kvctl(client, "audit", "--what-if", "temperature=1")
    assert same == {"knobs": {"overlap_score_credit": 1.0}, "decisions": 3, "changed": 0, "optimal_share": 1.0,
                    "optimal_share_then": 1.0, "avoidable_prefill_tokens": 0, "avoidable_prefill_tokens_then": 0}
    assert "What if overlap_score_credit=0.0:" in " ".join(table.stdout.split())
    assert bad.exit_code == 2 and "--what-if: overlap_score_credit must be a finite number >= 0" in bad.output
    assert unknown.exit_code == 2 and "expected KNOB=VALUE" in unknown.output


def test_a_frontends_own_counters_are_shown_beside_the_audit(tmp_path: Path) -> None:
    # A real Dynamo 1.6.1 frontend's /metrics, served as captured: its counters for its router, and that kvctl
    # heard none of that router's decisions (it was not on this router's event plane).
    server = ThreadingHTTPServer(("127.0.0.1", 0), metrics_handler(lambda: FRONTEND_METRICS, path="/metrics"))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    try:
        with loaded_router(tmp_path) as client:
            answer = json_of(kvctl(client, "audit", "--metrics", url, "-o", "json"))
            table = kvctl(client, "audit", "--metrics", url)
    finally:
        server.shutdown()
        server.server_close()
    (row,) = answer["self_report"]
    assert (row["model"], row["router"], row["kvctl"]) == ("tiny", FRONTEND_ROUTER, None)
    assert row["dynamo"] == {"best_eligible": 3840.0, "selected": 3456.0, "non_max": 0.0, "decisions": 24.0}
    said = " ".join(table.stdout.split())
    assert f"router {FRONTEND_ROUTER} (tiny) counts 24 decisions, best eligible 3,840, selected 3,456 cached tokens " \
        "(lost 384)" in said and "kvctl heard none of its decisions" in said
