"""Routing decision benchmark: a 2048-token request end to end in-process (hash the tokens, match them
in the index, price every candidate, pick), at 16 and 128 workers.

The index holds the synthetic workload of index_bench (shared 1024-token system prompts plus unique
suffixes, stored as vLLM does); each measured request is a system prompt plus a fresh 1024-token
suffix, so every decision walks a real partial hit. It is measured idle and with 64 requests in
flight (reserved on routing, freed 64 requests later), where the active-block term is computed too.
With the `oracle` extra the same requests go through Dynamo's `dynamo._core.SelectionService.select()`
in the same run. That service can only learn blocks from engines' ZMQ events, so it runs with
registered workers and an empty tree; the ratio is taken against kvctl on an empty index too (like for
like), and kvctl's populated figures are the ones the floor applies to.

    python benchmarks/route_bench.py [--requests 300] [--no-oracle]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvctl.core.events import RouterEvent, Stored  # noqa: E402
from kvctl.core.hashing import local_block_hashes, sequence_hashes  # noqa: E402
from kvctl.core.router.router import Router  # noqa: E402

BLOCK = 16
PROMPT_TOKENS = SUFFIX_TOKENS = 1024


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32_000) for _ in range(n)]


def populated_router(workers: int, pairs: int, seed: int = 5) -> tuple[Router, list[list[int]]]:
    """A router whose index holds `pairs` (worker, block) pairs; returns it and the system prompts."""
    rng = random.Random(seed)
    prompts = [_tokens(rng, PROMPT_TOKENS) for _ in range(8)]
    router = Router(block_size=BLOCK, rng=random.Random(seed))
    held = 0
    i = 0
    cached: set[tuple[int, int]] = set()
    while held < pairs:
        w, p = i % workers, rng.randrange(len(prompts))
        i += 1
        tokens = prompts[p] + _tokens(rng, SUFFIX_TOKENS)
        local = local_block_hashes(tokens, BLOCK)
        seq = sequence_hashes(local)
        start = PROMPT_TOKENS // BLOCK if (w, p) in cached else 0
        cached.add((w, p))
        parent = seq[start - 1] if start else None
        router.index.apply(RouterEvent(w, Stored(parent, seq[start:], local[start:])))
        held += len(seq) - start
    return router, prompts


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


def time_kvctl(router: Router, candidates: list[tuple[int, int]], requests: list[list[int]],
               in_flight: int = 0) -> dict:
    """Decision latency; with `in_flight`, each request is reserved and freed `in_flight` requests later."""
    samples = []
    clock = time.perf_counter_ns
    for i, tokens in enumerate(requests):
        t0 = clock()
        router.route(candidates, token_ids=tokens, request_id=str(i), reserve=in_flight > 0)
        samples.append((clock() - t0) / 1000)
        if in_flight:
            router.sequences.free(str(i - in_flight))
    return {"p50_us": _pct(samples, 0.5), "p99_us": _pct(samples, 0.99)}


async def _time_dynamo(workers: int, requests: list[list[int]]) -> dict:
    import zmq
    from dynamo._core import SelectionService

    ctx = zmq.Context()
    sockets = []
    service = SelectionService(indexer_threads=1)
    try:
        for w in range(workers):
            sock = ctx.socket(zmq.PUB)
            port = sock.bind_to_random_port("tcp://127.0.0.1")
            sockets.append(sock)
            endpoint = f"tcp://127.0.0.1:{port}"
            await service.upsert_worker({"worker_id": w + 1, "model_name": "bench", "block_size": BLOCK,
                                         "endpoint": endpoint, "kv_events_endpoint": endpoint})
        samples = []
        clock = time.perf_counter_ns
        for tokens in requests:
            t0 = clock()
            await service.select({"model_name": "bench", "token_ids": tokens})
            samples.append((clock() - t0) / 1000)
        return {"p50_us": _pct(samples, 0.5), "p99_us": _pct(samples, 0.99)}
    finally:
        service.shutdown()
        for sock in sockets:
            sock.close(0)
        ctx.term()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--pairs", type=int, default=100_000, help="(worker, block) pairs in the index")
    parser.add_argument("--no-oracle", action="store_true")
    args = parser.parse_args()
    try:
        import dynamo._core  # noqa: F401

        oracle = not args.no_oracle
    except ImportError:
        oracle = False
    for workers in (16, 128):
        router, prompts = populated_router(workers, args.pairs)
        rng = random.Random(workers)
        requests = [rng.choice(prompts) + _tokens(rng, SUFFIX_TOKENS) for _ in range(args.requests)]
        candidates = [(w, 0) for w in range(workers)]
        entry: dict = {"workers": workers, "request_tokens": PROMPT_TOKENS + SUFFIX_TOKENS, "pairs": args.pairs,
                       "kvctl_populated": time_kvctl(router, candidates, requests),
                       "kvctl_populated_64_in_flight": time_kvctl(router, candidates, requests, in_flight=64),
                       "kvctl_empty_index": time_kvctl(Router(block_size=BLOCK), candidates, requests)}
        if oracle:
            entry["dynamo_empty_index"] = asyncio.run(_time_dynamo(workers, requests))
            entry["kvctl_over_dynamo_p50_empty"] = round(
                entry["kvctl_empty_index"]["p50_us"] / entry["dynamo_empty_index"]["p50_us"], 2)
        print(json.dumps(entry), flush=True)


if __name__ == "__main__":
    main()
