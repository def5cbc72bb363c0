"""`kvctl tiers`, `top`'s tiers panel and `doctor`'s hit-rate check on a Dynamo 1.6.1 fleet's real `/metrics`:
the frontend's and a mocker's captured exposition (tests/fixtures/dynamo-1.6.1-fleet/metrics, README there).

The expected numbers are read off the captured text here with a regex of its own, not through kvctl's parser.
The fixtures are served over HTTP as captured; the frontend's endpoint answers its idle capture first, then the
loaded one, so a `--window` sees the load arrive as a real fleet's would.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

import pytest

from kvctl.client.tier_sources import parse_metrics
from kvctl.core.tiers import Window, check, increases, report
from kvctl.tui.sources import TierFeed
from tests.commands.live_router import loaded_router
from tests.doctor.rig import doctor, findings
from tests.fixtures_path import FIXTURES
from tests.tiers.conftest import tiers, tiers_json
from tests.tiers.exporter import TierExporter, metrics_handler

METRICS = FIXTURES / "dynamo-1.6.1-fleet" / "metrics"
FRONTEND_IDLE = (METRICS / "frontend-idle.prom").read_text()
FRONTEND = (METRICS / "frontend.prom").read_text()
MOCKER = (METRICS / "mocker.prom").read_text()
PREDICTED = "dynamo_component_router_kv_hit_rate (mean)"
CACHED = "dynamo_frontend_cached_tokens / dynamo_frontend_input_sequence_tokens (sums)"


def value(text: str, name: str) -> float:
    """The sum of every series of `name` in an exposition (a sample line: name, optional labels, value)."""
    found = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert found, name
    return sum(float(v) for v in found)


TRUE_PREDICTED = value(FRONTEND, "dynamo_component_router_kv_hit_rate_sum") / \
    value(FRONTEND, "dynamo_component_router_kv_hit_rate_count")
TRUE_CACHED = value(FRONTEND, "dynamo_frontend_cached_tokens_sum") / \
    value(FRONTEND, "dynamo_frontend_input_sequence_tokens_sum")
TRUE_USAGE = value(MOCKER, "vllm:kv_cache_usage_perc")


def since_start(**texts: str) -> list[Window]:
    return [Window(name, math.inf, increases((), parse_metrics(text))) for name, text in texts.items()]


def only(readings: list[dict[str, object]] | tuple[object, ...], **match: object) -> object:
    hits = [r for r in readings if all((r[k] if isinstance(r, dict) else getattr(r, k)) == v
                                       for k, v in match.items())]
    assert len(hits) == 1, (match, readings)
    return hits[0]


# ----- core: the captured text through kvctl's parser and math ------------------------------------------------

def test_the_captures_are_what_the_readme_says() -> None:
    assert "# TYPE dynamo_component_router_kv_hit_rate histogram" in FRONTEND
    assert 0 < TRUE_PREDICTED < 1 and 0 < TRUE_CACHED < 1
    assert "dynamo_frontend_cached_tokens_sum" not in FRONTEND_IDLE  # by model: there from the first request on
    assert value(FRONTEND_IDLE, "dynamo_component_router_kv_hit_rate_count") == 0


def test_frontend_router_prediction_is_the_histogram_mean_and_cached_share_the_ratio_of_sums() -> None:
    tier_report = report(since_start(frontend=FRONTEND))
    predicted = only(tier_report.readings, metric="predicted_hit_rate")
    assert predicted.family == PREDICTED and predicted.tier is None  # type: ignore[attr-defined]
    assert predicted.value == pytest.approx(TRUE_PREDICTED)  # type: ignore[attr-defined]
    cached = only(tier_report.readings, metric="cached_share")
    assert cached.family == CACHED and cached.tier is None  # type: ignore[attr-defined]
    assert cached.value == pytest.approx(TRUE_CACHED)  # type: ignore[attr-defined]
    assert cached.parts == (value(FRONTEND, "dynamo_frontend_cached_tokens_sum"),  # type: ignore[attr-defined]
                            value(FRONTEND, "dynamo_frontend_input_sequence_tokens_sum"))
    assert {"dynamo_component_router_kv_hit_rate", "dynamo_frontend_cached_tokens",
            "dynamo_frontend_input_sequence_tokens"} <= set(tier_report.found)


def test_an_idle_frontend_predicts_nothing_rather_than_zero() -> None:
    tier_report = report(since_start(frontend=FRONTEND_IDLE))
    assert only(tier_report.readings, metric="predicted_hit_rate").value is None  # type: ignore[attr-defined]
    assert not [r for r in tier_report.readings if r.metric == "cached_share"]


def test_a_window_from_idle_to_loaded_counts_the_load() -> None:
    """The cached-token series are absent from the idle scrape: they count from 0, as Prometheus would."""
    samples = increases(parse_metrics(FRONTEND_IDLE), parse_metrics(FRONTEND))
    tier_report = report([Window("frontend", 2.0, samples)])
    assert only(tier_report.readings, metric="predicted_hit_rate").value == pytest.approx(TRUE_PREDICTED)  # type: ignore[attr-defined]
    assert only(tier_report.readings, metric="cached_share").value == pytest.approx(TRUE_CACHED)  # type: ignore[attr-defined]


def test_mocker_kv_usage_and_no_tier_counters_said_once() -> None:
    tier_report = report(since_start(frontend=FRONTEND, mocker=MOCKER))
    usage = only(tier_report.readings, instance="mocker", metric="usage")
    assert (usage.tier, usage.family, usage.value) == ("device", "vllm:kv_cache_usage_perc", TRUE_USAGE)  # type: ignore[attr-defined]
    assert [r.metric for r in tier_report.readings if r.instance == "mocker"] == ["usage"]
    assert not [r for r in tier_report.readings if r.tier not in (None, "device")]
    assert tier_report.untiered == ("frontend", "mocker")
    assert tier_report.untiered_note == ("no tier counters exported by frontend, mocker: "
                                         "this fleet reports no host/disk/object tier hits")
    assert tier_report.to_dict()["no_tier_counters"]["instances"] == ["frontend", "mocker"]
    verdict = check(tier_report, "host", warn=0.2, crit=None)
    assert verdict.status == "UNKNOWN" and "no tier counters exported by frontend, mocker" in verdict.message


# ----- over HTTP: kvctl tiers, top's tiers feed, doctor ------------------------------------------------------

def _serve(texts: list[str]) -> ThreadingHTTPServer:
    """`/metrics` answering `texts` in turn, the last one from then on."""
    handler = metrics_handler(lambda: (texts.pop(0) if len(texts) > 1 else texts[0]).encode(), path="/metrics")
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class Captures:
    """The frontend's and the mocker's endpoints, each on a port of its own as in the fleet: the frontend answers
    its idle capture once, then the loaded one."""

    def __init__(self) -> None:
        self._servers = [_serve([FRONTEND_IDLE, FRONTEND]), _serve([MOCKER])]
        self.frontend_instance, self.mocker_instance = (f"127.0.0.1:{s.server_address[1]}" for s in self._servers)
        self.frontend, self.mocker = (f"http://{i}/metrics" for i in (self.frontend_instance, self.mocker_instance))

    def skip_idle(self) -> None:
        """Take the idle capture now: every later scrape sees the loaded fleet."""
        import httpx

        httpx.get(self.frontend, timeout=5)

    def close(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()


@pytest.fixture
def captures() -> Iterator[Captures]:
    served = Captures()
    yield served
    served.close()


def test_tiers_json_over_a_window(captures: Captures) -> None:
    doc = tiers_json("--window", "1s", "--wait", "--metrics", captures.frontend, "--metrics", captures.mocker)
    predicted = only(doc["readings"], metric="predicted_hit_rate")
    assert (predicted["value"], predicted["family"]) == (pytest.approx(TRUE_PREDICTED), PREDICTED)  # type: ignore[index]
    assert only(doc["readings"], metric="cached_share")["value"] == pytest.approx(TRUE_CACHED)  # type: ignore[index]
    assert only(doc["readings"], metric="usage")["value"] == TRUE_USAGE  # type: ignore[index]
    both = sorted([captures.frontend_instance, captures.mocker_instance])
    assert doc["no_tier_counters"] == {
        "instances": both,
        "note": f"no tier counters exported by {', '.join(both)}: this fleet reports no host/disk/object tier hits"}
    assert not [r for r in doc["readings"] if r["tier"] in ("host", "disk", "object")]


def test_tiers_table_says_it_once_and_shows_no_zero_rows(captures: Captures) -> None:
    captures.skip_idle()
    result = tiers("--window", "1s", "--metrics", captures.frontend, "--metrics", captures.mocker)
    assert result.exit_code == 0, result.output
    assert result.stderr.count("no tier counters exported by") == 1, result.stderr  # once for both tables
    _, _, window = result.stdout.partition("over the last 1s")
    # the quiet window: the prediction and the cached share are unknown, not 0 %; the idle mocker's usage is 0 %
    assert [line.split()[2] for line in window.splitlines() if "0.0%" in line] == ["usage"]
    assert len([line for line in window.splitlines() if "predicted_hit_rate" in line]) == 2  # and total
    assert "host" not in result.stdout and "disk" not in result.stdout


def test_tiers_check_of_a_lower_tier_is_unknown_naming_the_reason(captures: Captures) -> None:
    result = tiers("--window", "1s", "--metrics", captures.frontend, "--tier", "disk", "--warn", "0.1")
    assert result.exit_code == 3, result.output
    assert result.stdout.startswith("KVCTL TIERS UNKNOWN - no disk hit rate (no tier counters exported by ")


def test_only_the_instances_without_tier_counters_are_named(captures: Captures) -> None:
    exporter = TierExporter()  # KVBM, vLLM by source, ...: tier counters
    try:
        doc = tiers_json("--window", "1s", "--metrics", exporter.url, "--metrics", captures.mocker)
    finally:
        exporter.close()
    assert doc["no_tier_counters"] == {
        "instances": [captures.mocker_instance],
        "note": f"no tier counters exported by {captures.mocker_instance}: no host/disk/object tier hits from it"}


def test_tiers_panel_shows_the_router_and_cached_share_and_the_note(captures: Captures) -> None:
    now = [0.0]
    feed = TierFeed(metrics=[captures.frontend, captures.mocker], clock=lambda: now[0])
    try:
        assert feed.rates() == () and feed.note is None  # one scrape: no window yet
        now[0] = 5.0
        rates = feed.rates()
    finally:
        feed.close()
    shown = {(r.tier, r.family): r.hit_rate for r in rates}
    assert shown == {("router", PREDICTED): pytest.approx(TRUE_PREDICTED),
                     ("cached", CACHED): pytest.approx(TRUE_CACHED)}
    assert feed.note is not None and feed.note.startswith("no tier counters exported by ")


def test_tiers_panel_says_when_a_frontends_router_queue_holds_requests() -> None:
    """`kvctl top` showed a queueing fleet as idle workers (issue 38): the loaded capture, with 14 requests pending
    in the frontend's queue, puts how many wait, and where, in the panel's note."""
    pending = 'dynamo_frontend_router_queue_pending_requests{model="tiny",policy_class="default",worker_type="decode"}'
    assert f"{pending} 0\n" in FRONTEND
    server = _serve([FRONTEND_IDLE, FRONTEND.replace(f"{pending} 0\n", f"{pending} 14\n")])
    now = [0.0]
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    feed = TierFeed(metrics=[url], clock=lambda: now[0])
    try:
        feed.rates()
        assert feed.note is None  # one scrape, and an idle queue
        now[0] = 5.0
        feed.rates()
    finally:
        feed.close()
        server.shutdown()
        server.server_close()
    assert feed.note is not None
    assert feed.note.startswith(f"router queue: 14 requests waiting at {url}; no tier counters exported by ")


def test_doctor_compares_the_engines_reported_cache_hits_with_dynamo_s_prediction(
        captures: Captures, tmp_path: pytest.TempPathFactory) -> None:
    captures.skip_idle()
    with loaded_router(tmp_path) as client:  # type: ignore[arg-type]
        _, report = doctor(str(client.base_url).rstrip("/"), "--metrics", captures.frontend,
                           "--metrics", captures.mocker)
    [finding] = findings(report, "hit_rate")
    assert finding["severity"] == "OK", finding
    evidence = finding["evidence"]
    assert evidence["engines"] == {captures.frontend_instance: round(TRUE_CACHED, 3)}
    assert evidence["router_predicted"] == round(TRUE_PREDICTED, 3)
    assert evidence["router_predicted_by"] == PREDICTED


def test_a_class_the_frontend_exports_no_queue_for_is_none_not_zero() -> None:
    """Its queue series are there while idle, at 0: a route of another model or class must not read as 'nobody
    waits' (`kvctl route --metrics`)."""
    from kvctl.core.doctor.frontend_queue import pending_in_class

    samples = parse_metrics(FRONTEND)
    assert pending_in_class(samples, "tiny", "default", "decode") == 0
    assert pending_in_class(samples, "default", "default", "decode") is None  # kvctl's name, not the frontend's
    assert pending_in_class(samples, "tiny", "bulk", "decode") is None
    assert pending_in_class(samples, "tiny", "default", "prefill") is None
