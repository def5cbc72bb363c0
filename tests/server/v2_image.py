"""Images as kvctl wrote them before schema v3 (JSON lines, one Stored event per edge and holder): state dirs in
the field hold them, so tests write them to check that they still restore."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from kvctl.core.events.dynamo import encode_router_event_json
from kvctl.core.index.kv_index import events_of
from kvctl.server.persistence import snapshot
from kvctl.server.state import Fleet


def lines(taken: snapshot.Capture) -> Iterator[bytes]:
    """A capture's v2 lines, header first, without the trailer."""
    yield json.dumps(taken.header | {"schema": snapshot.V2}).encode() + b"\n"
    for name, edges in taken.models:
        prefix = b'{"model":' + json.dumps(name).encode() + b',"event":'
        for event in events_of(edges):
            yield prefix + encode_router_event_json(event) + b"}\n"


def with_trailer(body: Iterable[bytes]) -> Iterator[bytes]:
    digest, count = hashlib.sha256(), 0
    for line in body:
        digest.update(line)
        count += 1
        yield line
    yield json.dumps({"end": {"lines": count, "sha256": digest.hexdigest()}}).encode() + b"\n"


def write(fleet: Fleet, state_dir: Path, taken_at: float) -> Path:
    """The fleet as a v2 image, the newest in `state_dir` (the one before kept, as any write keeps it)."""
    return snapshot.install(with_trailer(lines(snapshot.capture(fleet, taken_at))), state_dir)
