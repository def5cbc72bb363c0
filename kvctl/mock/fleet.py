"""Several mock engines in one event loop: started together, stopped together, nothing left behind."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
from collections.abc import Callable, Collection, Sequence
from types import TracebackType
from typing import Any

from kvctl.mock.engine import EngineConfig, Faults, MockEngine
from kvctl.runtime import tune_gc
from kvctl.server.config_file import ModelSpec, ServeFile
from kvctl.server.worker_info import WorkerInfo

PORTS_PER_ENGINE = 3
"""With a base port P, engine i (from 0) takes P+3i (HTTP), P+3i+1 (ZMQ PUB), P+3i+2 (replay ROUTER)."""


def fleet_configs(
    count: int,
    base: EngineConfig,
    *,
    worker_ids: Sequence[int] | None = None,
    base_port: int = 0,
    faults: Faults | None = None,
    fault_engines: Collection[int] | None = None,
) -> list[EngineConfig]:
    """`count` engines like `base`, with worker ids 1..count (or `worker_ids`) and their own ports.

    `faults` go to the engines whose index (from 0) is in `fault_engines`, or to all of them.
    """
    ids = list(worker_ids) if worker_ids is not None else list(range(1, count + 1))
    if len(ids) != count or len(set(ids)) != count:
        raise ValueError(f"need {count} distinct worker ids, got {ids}")
    if fault_engines is not None and not set(fault_engines) <= set(range(count)):
        raise ValueError(f"fault engine indexes must be in 0..{count - 1}, got {sorted(fault_engines)}")
    configs = []
    for index, worker_id in enumerate(ids):
        ports = [base_port + PORTS_PER_ENGINE * index + k if base_port else 0 for k in range(PORTS_PER_ENGINE)]
        faulty = fault_engines is None or index in fault_engines
        configs.append(dataclasses.replace(base, worker_id=worker_id, http_port=ports[0], zmq_port=ports[1],
                                           replay_port=ports[2],
                                           faults=faults if faults is not None and faulty else base.faults))
    return configs


def serve_file(infos: Sequence[dict[str, Any]], block_size: int) -> ServeFile:
    """What `kvctl serve --config` needs to follow these engines (rows of `Fleet.infos`): their model at the
    fleet's block size (an engine with a faulty block size keeps its fault), and each one's endpoints; with their
    HTTP URLs, which `kvctl mock load --engines-file` reads from the same file."""
    models = [ModelSpec(model, block_size) for model in dict.fromkeys(info["model"] for info in infos)]
    workers = [WorkerInfo(info["worker_id"], info["dp_rank"], info["model"], endpoint=info["endpoint"],
                          replay_endpoint=info["replay_endpoint"], topic=info["topic"]) for info in infos]
    return ServeFile(models, workers, {(info["worker_id"], info["dp_rank"]): info["url"] for info in infos})


class Fleet:
    """Mock engines sharing the running loop; `async with Fleet(configs) as fleet:` starts and stops them."""

    def __init__(self, configs: Sequence[EngineConfig]) -> None:
        self.engines = [MockEngine(config) for config in configs]

    async def start(self) -> list[dict[str, Any]]:
        """Start every engine (stopping those already started if one fails); returns their `info()`."""
        try:
            for engine in self.engines:
                await engine.start()
        except BaseException:
            await self.close()
            raise
        return self.infos()

    def infos(self) -> list[dict[str, Any]]:
        return [engine.info() for engine in self.engines]

    async def close(self) -> None:
        """Close every engine at once: each HTTP server takes up to a tick (0.1 s) to notice."""
        await asyncio.gather(*(engine.close() for engine in self.engines))

    async def __aenter__(self) -> Fleet:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


async def run_until_stopped(fleet: Fleet, duration: float | None,
                            announce: Callable[[list[dict[str, Any]]], None]) -> None:
    """Start the fleet, announce it, and wait for a signal or the end of `duration`; always close."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    handled = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread, or Windows
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)
    try:
        async with fleet:
            tune_gc()  # the engines' frameworks frozen, young objects walked every 10,000 allocations
            announce(fleet.infos())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), duration)
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
