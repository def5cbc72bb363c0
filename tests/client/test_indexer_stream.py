"""A Dynamo indexer's `/dump` is read as it arrives (`sources.dynamo_indexer_stream`): the first events are in
the reader's hands while the indexer is still writing the rest, so `kvctl tree stats` holds one piece at a time."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvctl.client import sources
from kvctl.core.events.dump_file import read_router_events
from kvctl.errors import NotFound, UsageError
from tests.fixtures_path import FIXTURES

LINES = (FIXTURES / "dynamo-1.6.1" / "dump.jsonl").read_text().splitlines()


class Indexer:
    """A real HTTP server on loopback answering `/dump` in two halves, the second once `go` is set (or 10 s
    have passed): a reader that needs the whole answer first waits those 10 s."""

    def __init__(self, body: str) -> None:
        indexer = self
        self.go = threading.Event()
        self.finished = threading.Event()
        half = len(body) // 2

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[:half].encode())
                self.wfile.flush()
                indexer.go.wait(10)
                self.wfile.write(body[half:].encode())
                indexer.finished.set()

            def log_message(self, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.go.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def indexer() -> Iterator[Indexer]:
    events = ",".join(LINES * 200)  # ~0.5 MB: more than one piece of the answer
    served = Indexer(f'{{"other:0": {{"events": [{LINES[0]}]}}, '
                     f'"llama:0": {{"block_size": 16, "events": [{events}]}}}}')
    yield served
    served.close()


def test_the_first_events_come_while_the_rest_is_being_written(indexer: Indexer) -> None:
    with sources.dynamo_indexer_stream(indexer.url, model="llama", timeout=30) as events:
        first = next(events)
        assert not indexer.finished.is_set()  # the answer is not whole: it was read as it came
        indexer.go.set()
        rest = list(events)
    assert [first, *rest] == read_router_events("\n".join(LINES)) * 200


def test_the_models_are_told_apart_as_before(indexer: Indexer) -> None:
    indexer.go.set()
    with pytest.raises(UsageError, match="several models: llama:0, other:0"):
        sources.dynamo_indexer_events(indexer.url, model=None, timeout=30)
    with pytest.raises(NotFound, match=r"no model 'nope' \(it has: llama:0, other:0\)"):
        sources.dynamo_indexer_events(indexer.url, model="nope", timeout=30)
    assert sources.dynamo_indexer_events(indexer.url, model="other", timeout=30) == read_router_events(LINES[0])
