"""A mock LLM engine: real KV events and metrics from a simulated prefix cache, no GPU.

Each request is admitted into a bounded batch (the rest wait in a bounded queue, then get 503),
pins its prompt blocks in the cache, and the cache's changes go out at once as one event batch in
the engine's wire format, so the events follow the order of the cache's changes as a real
scheduler step would. Then the request runs in the engine's step scheduler (`scheduler.py`), which
shares the engine's time between requests as a GPU does, each step timed by Dynamo's mocker
polynomial model (`timing.py`): a cache hit saves prefill time and frees the engine for others. The
client sees NDJSON lines when the first token is out and when the request is done.

Faults reproduce the incidents kvctl diagnoses: lost batches (drop_every), an engine restart
(restart_after), a block size or hash seed the router does not share, an engine that stops
publishing (silent), and an overloaded one (slow). A cache reset (POST /v1/clear), unlike a restart,
is announced as vLLM's reset_prefix_cache announces it: AllBlocksCleared, seq going on.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import socket
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvctl.core.events.engine_encode import (
    FORMATS,
    SGLANG,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineEvent,
    encode_batch,
)
from kvctl.core.events.plane import PlaneNames
from kvctl.core.events.types import Tier
from kvctl.mock.cache import Allocation, CacheCleared, CacheEvent, CacheStored, PrefixCache
from kvctl.mock.hashing import BlockHasher, HashStyle
from kvctl.mock.metrics import EngineMetrics
from kvctl.mock.nats_publisher import EngineGauges, NatsEventPublisher
from kvctl.mock.publisher import Publisher
from kvctl.mock.scheduler import StepScheduler
from kvctl.mock.timing import TimingModel

MOCK_FORMATS = ("vllm", "vllm-legacy", "sglang", "dynamo-nats")
"""The wire formats a mock engine can speak: engine ZMQ (names of `engine_encode.FORMATS`), or a Dynamo
worker's RouterEvents on a NATS event plane."""
DYNAMO_NATS = "dynamo-nats"

SLOW_FACTOR = 25.0
"""How much longer every scheduler step (prefill and decode) takes on a `slow` engine."""


@dataclass(frozen=True, slots=True)
class Faults:
    """Misbehaviours of one engine; the defaults are a healthy engine."""

    drop_every: int = 0
    """Do not send every Nth batch on PUB (it stays in the replay buffer): seq gaps a router can repair."""
    restart_after: float | None = None
    """After this many seconds, restart once: cache, seq and replay buffer start over, silently."""
    block_size: int | None = None
    """Use this block size instead of the fleet's (a router configured for another size never matches)."""
    nondeterministic_hash: bool = False
    """Seed the hash chain randomly per engine, as vLLM did before its fix: no two engines agree."""
    silent: bool = False
    """Publish nothing at all, but keep serving requests."""
    slow: bool = False
    """Prefill and decode SLOW_FACTOR times slower: load builds up and requests queue."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    worker_id: int
    dp_rank: int = 0
    block_size: int = 16
    capacity: int = 2048
    host_capacity: int = 0
    disk_capacity: int = 0
    format: str = "vllm"
    host: str = "127.0.0.1"
    http_port: int = 0
    zmq_port: int = 0
    replay_port: int = 0
    topic: str = ""
    model_name: str = "mock"
    speedup: float = 1.0
    """Run the timing model this many times faster (Dynamo mocker's speedup ratio)."""
    max_running: int = 16
    max_batched_tokens: int = 8192
    """Prefill tokens one scheduler step computes at most (vLLM's online default); longer prompts are chunked."""
    max_waiting: int = 256
    seed: int | None = None
    """Makes a nondeterministic hash seed reproducible (per worker id)."""
    faults: Faults = field(default_factory=Faults)
    nats_url: str | None = None  # dynamo-nats: the event plane's server, and the worker's namespace,
    namespace: str = "dynamo"  # component and endpoint
    component: str = "backend"
    endpoint: str = "generate"

    def __post_init__(self) -> None:
        if self.format not in MOCK_FORMATS:
            raise ValueError(f"format must be one of {', '.join(MOCK_FORMATS)}, got {self.format!r}")
        if self.format == DYNAMO_NATS and not self.nats_url:
            raise ValueError("the dynamo-nats format needs a NATS URL")
        if min(self.block_size, self.capacity, self.max_running, self.max_batched_tokens) <= 0 \
                or self.faults.block_size == 0 or not self.speedup > 0:
            raise ValueError("block size, capacity, speedup, max running and max batched tokens must be positive")
        if min(self.host_capacity, self.disk_capacity, self.max_waiting, self.faults.drop_every) < 0:
            raise ValueError("tier capacities, max waiting and drop_every must not be negative")

    @property
    def effective_block_size(self) -> int:
        return self.faults.block_size or self.block_size


class GenerateRequest(msgspec.Struct):
    token_ids: Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=2**32)]], msgspec.Meta(min_length=1)]
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 16
    request_id: str | None = None


_GENERATE_REQUEST = msgspec.json.Decoder(GenerateRequest)


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals alone: several share one loop, and their owner handles signals."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        return contextlib.nullcontext()


class MockEngine:
    """One engine (one dp rank): a prefix cache, its KV-event publisher and an HTTP API."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.fmt = FORMATS["vllm" if config.format == DYNAMO_NATS else config.format]
        self.block_size = config.effective_block_size
        style = HashStyle.sglang if self.fmt is SGLANG else HashStyle.vllm
        self.cache = PrefixCache(config.capacity, self.block_size, BlockHasher(style, root_seed=self._root_seed()),
                                 host_capacity=config.host_capacity, disk_capacity=config.disk_capacity)
        self.timing = TimingModel(config.speedup)
        self.restarts = 0
        self.clears = 0
        self.metrics = EngineMetrics(
            model_name=config.model_name, block_size=self.block_size,
            usage=self.kv_usage,
            running=lambda: self.running, waiting=lambda: self.waiting,
            transfers=self.cache.transfers if config.host_capacity or config.disk_capacity else None,
            lower_tiers=[tier for tier, blocks in ((Tier.host_pinned, config.host_capacity),
                                                   (Tier.disk, config.disk_capacity)) if blocks],
        )
        self.scheduler = StepScheduler(self.timing, max_running=config.max_running,
                                       max_batched_tokens=config.max_batched_tokens,
                                       kv_usage=self.kv_usage, stepped=self.metrics.step,
                                       slowdown=SLOW_FACTOR if config.faults.slow else 1.0)
        self.publisher: Publisher | None = None
        self.nats: NatsEventPublisher | None = None
        self._socket: socket.socket | None = None
        self._url: str | None = None
        self._server: _Server | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def running(self) -> int:
        return self.scheduler.running

    @property
    def waiting(self) -> int:
        return self.scheduler.waiting

    def kv_usage(self) -> float:
        """Device blocks pinned by running requests over all device blocks: vLLM's KV usage."""
        return self.cache.used_blocks / self.config.capacity

    @property
    def url(self) -> str:
        assert self._url is not None, "the engine is not started"
        return self._url

    def info(self) -> dict[str, Any]:
        """Where to reach this engine; the first six keys are what a router's POST /v1/workers takes."""
        assert self.publisher is not None, "the engine is not started"
        return {
            "worker_id": self.config.worker_id,
            "dp_rank": self.config.dp_rank,
            "endpoint": None if self.nats else self.publisher.endpoint,
            "replay_endpoint": None if self.nats else self.publisher.replay_endpoint,
            "model": self.config.model_name,
            "topic": self.config.topic,
            "url": self.url,
            "format": self.config.format,
            "block_size": self.block_size,
            "max_running": self.config.max_running,
            "max_batched_tokens": self.config.max_batched_tokens,
            "timing": self.timing.describe(),
        }

    async def start(self) -> None:
        """Bind every socket (ZMQ and HTTP), then serve; returns once the HTTP server accepts requests."""
        c = self.config
        self.publisher = Publisher(c.host, c.zmq_port, c.replay_port, topic=c.topic, replay_topic=self.fmt.replay_topic)
        self.publisher.start()
        if c.format == DYNAMO_NATS:
            assert c.nats_url is not None
            gauges = EngineGauges(lambda: self.cache.used_blocks, lambda: self.running, lambda: self.waiting)
            self.nats = NatsEventPublisher(c.nats_url, PlaneNames(c.namespace, c.component, c.endpoint), c.worker_id,
                                           c.dp_rank, self.block_size, gauges)
            await self.nats.start()
        self._socket = socket.create_server((c.host, c.http_port))
        self._url = f"http://{c.host}:{self._socket.getsockname()[1]}"
        config = uvicorn.Config(self._app(), log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=1)
        self._server = _Server(config)
        serving = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._socket]))
        self._tasks.append(serving)
        while not self._server.started:
            if serving.done():
                serving.result()  # re-raise why it stopped
                raise RuntimeError(f"engine {c.worker_id}: the HTTP server stopped while starting")
            await asyncio.sleep(0.005)
        if c.faults.restart_after is not None:
            self._tasks.append(asyncio.get_running_loop().create_task(self._restart_later(c.faults.restart_after)))

    async def close(self) -> None:
        """Stop serving (in-flight streams get a second to finish) and close every socket."""
        if self._server is not None:
            self._server.should_exit = True
        for task in self._tasks[1:]:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        await self.scheduler.close()
        if self._socket is not None:
            self._socket.close()
        if self.publisher is not None:
            await self.publisher.close()
        if self.nats is not None:
            await self.nats.close()

    def restart(self) -> None:
        """What a crashed-and-restarted engine looks like from outside: empty cache, seq from 0, no events."""
        assert self.publisher is not None
        self.cache.clear()  # its AllBlocksCleared is not sent: a crashed engine says nothing
        self.publisher.reset()
        if self.nats is not None:
            self.nats.reset()
        self.restarts += 1

    def clear_cache(self) -> None:
        """vLLM's reset_prefix_cache: an empty cache, announced with AllBlocksCleared in the same stream (seq
        goes on), so a router empties this worker and sees no restart."""
        self._emit(self.cache.clear())
        self.clears += 1

    async def generate(self, request: GenerateRequest) -> AsyncIterator[bytes]:
        """Queue, prefill, decode in the engine's scheduler: one NDJSON line when the first token is out, one when
        done. The cache allocation and its event batch happen when the scheduler admits the request."""
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        prompt = len(request.token_ids)
        allocation: Allocation | None = None

        def admit() -> int:
            nonlocal allocation
            allocation = self.cache.allocate(request.token_ids)
            self._emit(allocation.events)
            self.metrics.record(allocation, prompt)
            return prompt - allocation.cached_blocks * self.block_size

        def release() -> None:
            assert allocation is not None
            self.cache.release(allocation)

        job = self.scheduler.submit(request.max_tokens, admit, release)
        try:
            await job.until(job.first_token)
            assert allocation is not None
            yield _line(event="first_token", request_id=request.request_id,
                        cached_tokens=allocation.cached_blocks * self.block_size, prompt_tokens=prompt,
                        ttft_ms=(loop.time() - arrived) * 1e3)
            await job.until(job.finished)
            yield _line(event="done", request_id=request.request_id, output_tokens=request.max_tokens,
                        total_ms=(loop.time() - arrived) * 1e3)
        finally:
            self.scheduler.discard(job)

    def _emit(self, changes: Sequence[CacheEvent]) -> None:
        """Publish one batch of cache changes, unless faults say otherwise."""
        assert self.publisher is not None
        faults = self.config.faults
        if not changes or faults.silent:
            return
        if self.nats is not None:
            self.nats.publish(changes)
            return
        payload = encode_batch(self.fmt, time.time(), [self._engine_event(c) for c in changes], self.config.dp_rank)
        dropped = faults.drop_every and (self.publisher.next_seq + 1) % faults.drop_every == 0
        self.publisher.publish(payload, live=not dropped)

    def _engine_event(self, change: CacheEvent) -> EngineEvent:
        if isinstance(change, CacheCleared):
            return AllBlocksCleared()
        medium = self.fmt.mediums[change.tier]
        if isinstance(change, CacheStored):
            return BlockStored(change.hashes, change.parent, change.tokens, self.block_size, medium=medium,
                               extra=self.fmt.plain_stored_extra(len(change.hashes)))
        return BlockRemoved(change.hashes, medium=medium, extra=self.fmt.plain_removed_extra())

    def _root_seed(self) -> bytes | None:
        if not self.config.faults.nondeterministic_hash:
            return None
        if self.config.seed is None:
            return os.urandom(32)
        return hashlib.sha256(f"{self.config.seed}:{self.config.worker_id}".encode()).digest()

    async def _restart_later(self, delay: float) -> None:
        await asyncio.sleep(delay)
        self.restart()

    def _app(self) -> Starlette:
        async def generate(request: Request) -> Response:
            try:
                body = _GENERATE_REQUEST.decode(await request.body())
            except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # msgspec.ValidationError included
                return JSONResponse({"error": f"invalid generate request: {exc}"}, status_code=422)
            if self.waiting >= self.config.max_waiting:
                return JSONResponse({"error": "the waiting queue is full"}, status_code=503)
            return StreamingResponse(self.generate(body), media_type="application/x-ndjson")

        async def restart(_: Request) -> Response:
            """A crash and restart on demand: cold cache, seq from 0, nothing published about it."""
            self.restart()
            return JSONResponse({"worker_id": self.config.worker_id, "restarts": self.restarts})

        async def clear(_: Request) -> Response:
            """A cache reset, as vLLM's POST /reset_prefix_cache: cold cache, announced (AllBlocksCleared)."""
            self.clear_cache()
            return JSONResponse({"worker_id": self.config.worker_id, "clears": self.clears})

        async def metrics(_: Request) -> Response:
            return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

        async def healthz(_: Request) -> Response:
            return JSONResponse({"status": "ok"})

        async def info(_: Request) -> Response:
            return JSONResponse(self.info())

        return Starlette(routes=[
            Route("/v1/generate", generate, methods=["POST"]), Route("/v1/restart", restart, methods=["POST"]),
            Route("/v1/clear", clear, methods=["POST"]), Route("/metrics", metrics, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]), Route("/v1/info", info, methods=["GET"])])


def _line(**fields: Any) -> bytes:
    return (json.dumps({k: v for k, v in fields.items() if v is not None}) + "\n").encode()
