"""`GET /v1/workers`' rows (and `POST /v1/workers`' one): the fleet's own (`Fleet.worker_rows`), joined with what
follows each worker. With an event plane, `event_plane`: where its events come from. With an engine stream,
`groups`, `salts_seen` and `events_dropped`: its stream's normalizer's (`StreamDrops.status`), the one source that
`/v1/status` shows under `streams` too, so a worker's row and its stream's never disagree."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from kvctl import http_api as api
from kvctl.server.ingest.streams import Streams
from kvctl.server.state import Fleet

if TYPE_CHECKING:
    from kvctl.server.http.metrics import Plane


def worker_rows(fleet: Fleet, now: float, streams: Streams | None, plane: Plane | None) -> list[api.Worker]:
    rows = fleet.worker_rows(now)
    if plane is not None:  # where each worker's events come from on the event plane
        sources = {(r["worker_id"], r["dp_rank"]): r for r in plane.worker_sources()}
        for row in rows:
            source = sources.get((row.worker_id, row.dp_rank))
            row.event_plane = None if source is None else {
                k: v for k, v in source.items() if k not in ("worker_id", "dp_rank")}
    if streams is not None:  # what its engine stream kept and dropped, as Dynamo 1.6.1 would
        drops = streams.drops()
        for row in rows:
            seen = drops.get((row.worker_id, row.dp_rank))
            if seen is not None:
                row.groups = msgspec.convert(seen["groups"], list[api.KvCacheGroup])
                row.salts_seen = seen["salts_seen"]
                row.events_dropped = seen["events_dropped"]
    return rows
