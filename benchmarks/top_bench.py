"""How long one `kvctl top` refresh takes with 256 workers: the fake source, headless, through Pilot.

    python benchmarks/top_bench.py [--workers 256] [--refreshes 40]

A refresh is: poll (the fake answers at once), build the frame, update every panel, then let Textual
process what that queued and repaint the screen. Timed per refresh, medians printed as one JSON line,
for two tables: sorted by worker (same order each time: cells updated in place) and sorted by blocks
(the order changes every poll: the table is rebuilt), with the collector tuned as `kvctl top` tunes it.
Target (issue 9): <= 50 ms.

Waiting for the repaint uses two private Pilot/Screen steps (`_wait_for_screen`, `_on_timer_update`):
`pilot.pause()` would add its idle-detection sleeps to every sample.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the fake source lives in the tests

from kvctl.runtime import tuned_gc  # noqa: E402
from kvctl.tui.app import TopApp  # noqa: E402
from kvctl.tui.frame import SORTS  # noqa: E402
from tests.tui.fake import FakeSource, fleet  # noqa: E402

SIZE = (160, 50)


async def _measure(workers: int, refreshes: int, sort_field: str | None) -> list[float]:
    app = TopApp(FakeSource(fleet(workers)), interval=3600.0)
    async with app.run_test(size=SIZE) as pilot:
        app.sort = next(s for s in SORTS if s.field == sort_field)
        for _ in range(3):  # warm-up: the first frames create the rows
            await app.refresh_frame()
            await pilot.pause()
        times = []
        for _ in range(refreshes):
            started = time.perf_counter()
            await app.refresh_frame()
            await pilot._wait_for_screen()  # noqa: SLF001 - see the module docstring
            app.screen._on_timer_update()  # noqa: SLF001 - the repaint, now rather than at the next timer tick
            times.append((time.perf_counter() - started) * 1000)
        return times


def _summary(times: list[float]) -> dict[str, float]:
    return {"median_ms": round(statistics.median(times), 2), "p90_ms": round(sorted(times)[int(0.9 * len(times))], 2),
            "max_ms": round(max(times), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=256)
    ap.add_argument("--refreshes", type=int, default=40)
    args = ap.parse_args()
    result = {"workers": args.workers, "refreshes": args.refreshes, "terminal": list(SIZE)}
    for name, field in (("sorted_by_worker", None), ("sorted_by_blocks", "blocks")):
        with tuned_gc():  # as `kvctl top` runs the app
            result[name] = _summary(asyncio.run(_measure(args.workers, args.refreshes, field)))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
