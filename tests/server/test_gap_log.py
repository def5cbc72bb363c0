"""Lost gaps in the serve log: the first at once, then a summary per stream at most every GAP_SUMMARY_S,
and the totals when the stream stops; never a line per gap."""

from __future__ import annotations

import json
import logging
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvctl.server.ingest.gap_log import GAP_SUMMARY_S, GapLog
from tests.server.test_serve_process import serving


def test_losses_after_the_first_are_summed_up_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    gaps = GapLog("engine stream 3:0 (tcp://e:5557)", lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kvctl.server.ingest.gap_log"):
        gaps.lost(10, 12, "no replay endpoint")
        for seq in range(20, 70, 5):  # ten more single-batch gaps within the interval: no line yet
            now[0] += 0.5
            gaps.lost(seq, seq, "no replay endpoint")
        gaps.flush()
        quiet = len(caplog.messages)
        now[0] = 100.0 + GAP_SUMMARY_S
        gaps.flush()  # the next tick: the summary is due, no new loss needed
        gaps.flush()
        now[0] += 3 * GAP_SUMMARY_S
        gaps.lost(90, 91, "replay timed out after 2 s")  # due at once: the last line is long past
        gaps.close()
    assert quiet == 1
    assert caplog.messages == [
        "engine stream 3:0 (tcp://e:5557): seq gap 10..12 lost (no replay endpoint); further losses are summed up "
        f"every {GAP_SUMMARY_S:g} s",
        f"engine stream 3:0 (tcp://e:5557): 10 more gaps lost in the last {GAP_SUMMARY_S:.0f} s, 10 batches",
        f"engine stream 3:0 (tcp://e:5557): 1 more gap lost in the last {3 * GAP_SUMMARY_S:.0f} s, 2 batches",
        "engine stream 3:0 (tcp://e:5557): stopped; 12 gaps lost in all, 15 batches",
    ]


def test_a_stream_that_lost_nothing_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    gaps = GapLog("engine stream 1:0", lambda: 0.0)
    with caplog.at_level(logging.DEBUG, logger="kvctl.server.ingest.gap_log"):
        gaps.flush()
        gaps.close()
    assert caplog.messages == []


def _stream(client: httpx.Client) -> dict:
    """The engine stream's counts."""
    (stream,) = client.get("/v1/status").json()["streams"]
    return {key: stream[key] for key in ("messages", "gaps", "lost_batches")}


def test_serve_logs_a_dropping_engines_gaps_in_a_bounded_number_of_lines(tmp_path: Path) -> None:
    """`kvctl mock --drop-every 2` without its replay endpoint: every other batch is lost for good."""
    cmd = [sys.executable, "-m", "kvctl", "mock", "--engines", "1", "--drop-every", "2", "-o", "json"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as mock:
        try:
            assert mock.stdout is not None
            (engine,) = json.loads(mock.stdout.readline())
            with serving(tmp_path, "--no-restore", "--worker", f"1={engine['endpoint']}") as (proc, client), \
                    httpx.Client(base_url=engine["url"], timeout=10) as eng:

                def generate(n: int) -> None:
                    eng.post("/v1/generate", json={"token_ids": [n * 1000 + t for t in range(32)], "max_tokens": 1})

                n, deadline = 0, time.monotonic() + 30
                while not _stream(client)["messages"]:  # until the router's SUB hears the engine
                    assert time.monotonic() < deadline, "the router never heard the engine"
                    generate(n := n + 1)
                    time.sleep(0.05)
                begun = time.monotonic()
                for more in range(n + 1, n + 61):
                    generate(more)
                stream, previous = _stream(client), None
                while stream != previous:  # until every batch the engine sent is in (the counts stay put)
                    assert time.monotonic() < deadline, stream
                    time.sleep(0.2)
                    stream, previous = _stream(client), stream
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(timeout=15) == 0
                ended = time.monotonic()
                assert proc.stderr is not None
                log = proc.stderr.read()
        finally:
            mock.terminate()
            mock.wait(10)
    lines = [line for line in log.splitlines() if "lost" in line]
    assert stream["gaps"] >= 25 and stream["lost_batches"] == stream["gaps"]  # one batch a gap
    assert len(lines) <= 2 + 1 + (ended - begun) / GAP_SUMMARY_S, lines  # first, summaries, totals
    assert "seq gap" in lines[0] and "(no replay endpoint)" in lines[0]
    summaries = [int(m.group(1)) for line in lines if (m := re.search(r": (\d+) more gaps? lost", line))]
    assert len(summaries) <= 1 + (ended - begun) / GAP_SUMMARY_S
    assert lines[-1].endswith(f"stopped; {stream['gaps']} gaps lost in all, {stream['lost_batches']} batches")
    assert len(lines) == 2 + len(summaries), lines
    assert 1 + sum(summaries) <= stream["gaps"]
