"""A Dynamo 1.6.1 frontend's `/metrics` as captured (tests/fixtures/dynamo-1.6.1-fleet/metrics/frontend.prom),
served with its counters growing: every counter, histogram and summary sample is multiplied by the seconds since
start (plus one) at each scrape, so rates are positive and every ratio of two of them is the captured one.

It stands in for a live frontend where the dashboard's and the rules' Dynamo queries must return data: the names,
labels and types are Dynamo's own."""

from __future__ import annotations

import re
import threading
import time
from http.server import ThreadingHTTPServer

from tests.fixtures_path import FIXTURES
from tests.tiers.exporter import metrics_handler

CAPTURE = FIXTURES / "dynamo-1.6.1-fleet" / "metrics" / "frontend.prom"
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{.*\})? (\S+)$")
_SUFFIX = re.compile(r"_(total|bucket|sum|count)$")
"""A sample's suffix after its family's name (a counter's TYPE line names it with or without `_total`)."""


class DynamoFrontend:
    def __init__(self) -> None:
        lines = CAPTURE.read_text().splitlines()
        self._growing = {line.split()[2] for line in lines
                         if line.startswith("# TYPE ") and line.split()[3] in ("counter", "histogram", "summary")}
        self._lines = lines
        self._started = time.monotonic()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), metrics_handler(self.body))
        self._thread = threading.Thread(target=self._server.serve_forever, name="dynamo-frontend", daemon=True)
        self._thread.start()
        self.instance = f"127.0.0.1:{self._server.server_address[1]}"

    def body(self) -> bytes:
        factor = 1.0 + time.monotonic() - self._started
        return ("\n".join(self._scaled(line, factor) for line in self._lines) + "\n").encode()

    def _scaled(self, line: str, factor: float) -> str:
        match = _SAMPLE.match(line)
        if match is None or not {match.group(1), _SUFFIX.sub("", match.group(1))} & self._growing:
            return line
        name, labels, value = match.groups()
        return f"{name}{labels or ''} {float(value) * factor!r}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
