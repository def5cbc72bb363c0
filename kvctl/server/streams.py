"""The running engine streams of a router: started when a worker with an endpoint is registered (flag or
`POST /v1/workers`), stopped when it is removed, reported by `GET /v1/status`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

from kvctl.core.events import EventData
from kvctl.server.state import Fleet, WorkerInfo
from kvctl.server.zmq_source import EngineStream

log = logging.getLogger("kvctl.serve")
Worker = tuple[int, int]


class Streams:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self._running: dict[Worker, tuple[EngineStream, asyncio.Task[None]]] = {}

    def start(self, info: WorkerInfo) -> bool:
        """Subscribe to a worker's engine; False when it has no endpoint or is already subscribed."""
        if not info.endpoint or info.key in self._running:
            return False
        model = info.model

        def sink(worker: Worker, events: list[EventData]) -> None:
            self.fleet.apply_engine_batch(model, worker, events, time.monotonic())

        def on_restart(worker: Worker) -> None:
            log.warning("engine %s:%s restarted (its seq went back): clearing its blocks", *worker)
            self.fleet.reset(model, worker[0], worker[1])

        stream = EngineStream(worker=info.key, endpoint=info.endpoint, replay_endpoint=info.replay_endpoint,
                              topic=info.topic, block_size=self.fleet.model(model).block_size, sink=sink,
                              on_restart=on_restart)
        self._running[info.key] = (stream, asyncio.get_running_loop().create_task(self._run(stream)))
        return True

    async def _run(self, stream: EngineStream) -> None:
        try:
            await stream.run()
        except Exception:  # a stream must never take the daemon down; it is reported and stays stopped
            log.exception("engine stream %s stopped", stream.stats.endpoint)

    async def stop(self, worker_id: int, dp_rank: int | None = None) -> int:
        keys = [k for k in self._running if k[0] == worker_id and (dp_rank is None or k[1] == dp_rank)]
        for key in keys:
            stream, task = self._running.pop(key)
            stream.close()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return len(keys)

    async def close(self) -> None:
        for worker_id, dp_rank in list(self._running):
            await self.stop(worker_id, dp_rank)

    def status(self) -> list[dict[str, Any]]:
        out = []
        for (worker_id, dp_rank), (stream, _) in sorted(self._running.items()):
            stats = dataclasses.asdict(stream.stats)
            stats["worker"] = {"worker_id": worker_id, "dp_rank": dp_rank}
            stats["schema"] = {k: sorted(v) for k, v in stats["schema"].items()}
            stats["last_event_age_s"] = None if stats["last_event_at"] is None else round(
                time.monotonic() - stats["last_event_at"], 3)
            out.append(stats)
        return out
