"""Radix index benchmark: kvctl's KvIndex against Dynamo 1.6.1's own RadixTree, on the same events.

Workloads
- synthetic (seeded): S shared system prompts of 64 blocks; each request is a system prompt plus 64
  unique blocks (128 blocks), and 1 request in 32 is a 1024-block document. Requests are spread over
  W workers until they hold N (worker, block) pairs. A worker's first request for a prompt stores it
  whole from the root; later ones store only their suffix under the prompt's last block, as vLLM does.
- mooncake: the FAST'25 conversation and synthetic traces (fixtures/traces), each request's
  hash_ids a chain of blocks, requests assigned round robin to W workers.

Measured (events decoded before timing): stored and removed blocks/s (removals are one event per
request, as Dynamo's publisher batches them), find_matches p50/p99 for 128- and 1024-block queries
(full hits) and misses, bytes per (worker, block) (kvctl: tracemalloc; both: RSS growth), and
remove_worker milliseconds. Each configuration runs in a fresh subprocess; `--repeat` runs give
medians. With the `oracle` extra installed the same events go through `dynamo._core.RadixTree`
(its `apply_event` takes KvCacheEvent JSON bytes, encoded before timing) and ratios are printed.

    python benchmarks/index_bench.py                  # 100k pairs x 16 and 128 workers, 1M x 16 and 128
    python benchmarks/index_bench.py --quick          # 100k x 16 only
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvctl.core.events import Removed, RouterEvent, Stored  # noqa: E402
from kvctl.core.index import KvIndex  # noqa: E402

TRACES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "traces"
MASK = (1 << 64) - 1
PROMPT_BLOCKS, SUFFIX_BLOCKS, DOC_BLOCKS = 64, 64, 1024


def _mix(parent: int, local: int) -> int:
    """A cheap stand-in for an engine's chained block hash (uniform across workers, as vLLM's is)."""
    x = (parent * 0x9E3779B97F4A7C15 + local) & MASK
    x ^= x >> 31
    return (x * 0xBF58476D1CE4E5B9) & MASK


class Workload:
    def __init__(self) -> None:
        self.stores: list[tuple[int, int | None, array, array]] = []  # worker, parent, hashes, locals
        self.requests: list[tuple[int, array, array]] = []  # worker, hashes, locals (whole path)
        self.pairs = 0


def synthetic(pairs: int, workers: int, seed: int = 7, prompts: int = 8) -> Workload:
    rng = random.Random(seed)
    wl = Workload()
    prompt_locals = [array("Q", (rng.getrandbits(64) for _ in range(PROMPT_BLOCKS))) for _ in range(prompts)]
    prompt_hashes = []
    for locs in prompt_locals:
        h, chain = 0, array("Q")
        for local in locs:
            h = _mix(h, local)
            chain.append(h)
        prompt_hashes.append(chain)
    cached: set[tuple[int, int]] = set()
    per_worker = [0] * workers
    i = 0
    while wl.pairs < pairs:
        w = i % workers
        i += 1
        p = rng.randrange(prompts)
        n = DOC_BLOCKS - PROMPT_BLOCKS if i % 32 == 0 else SUFFIX_BLOCKS
        locs = array("Q", (rng.getrandbits(64) for _ in range(n)))
        h, hashes = prompt_hashes[p][-1], array("Q")
        for local in locs:
            h = _mix(h, local)
            hashes.append(h)
        if (w, p) in cached:
            wl.stores.append((w, prompt_hashes[p][-1], hashes, locs))
            wl.pairs += n
        else:
            cached.add((w, p))
            wl.stores.append((w, None, prompt_hashes[p] + hashes, prompt_locals[p] + locs))
            wl.pairs += n + PROMPT_BLOCKS
        per_worker[w] += n
        wl.requests.append((w, prompt_hashes[p] + hashes, prompt_locals[p] + locs))
    return wl


def mooncake(name: str, workers: int) -> Workload:
    """Each trace request's hash_ids as a chain; a worker stores what it does not yet hold."""
    wl = Workload()
    held: list[set[int]] = [set() for _ in range(workers)]
    with (TRACES / name).open() as f:
        for i, line in enumerate(f):
            ids = json.loads(line)["hash_ids"]
            w = i % workers
            locs = array("Q", (hid * 0x100000001B3 & MASK for hid in ids))
            hashes, h = array("Q"), 0
            for local in locs:
                h = _mix(h, local)
                hashes.append(h)
            k = 0
            while k < len(hashes) and hashes[k] in held[w]:
                k += 1
            if k < len(hashes):
                wl.stores.append((w, hashes[k - 1] if k else None, hashes[k:], locs[k:]))
                held[w].update(hashes[k:])
                wl.pairs += len(hashes) - k
            wl.requests.append((w, hashes, locs))
    return wl


def _events(wl: Workload) -> tuple[list[RouterEvent], list[RouterEvent]]:
    """Events as a decoder hands them over: hashes as lists of Python ints."""
    stores = [RouterEvent(w, Stored(parent, hashes.tolist(), locs.tolist()), 0, i)
              for i, (w, parent, hashes, locs) in enumerate(wl.stores)]
    removes = [RouterEvent(w, Removed(hashes.tolist()), 0, i)
               for i, (w, _, hashes, _) in enumerate(reversed(wl.stores))]
    return stores, removes


def _queries(wl: Workload, length: int, count: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    long_enough = [locs for _, _, locs in wl.requests if len(locs) >= length]
    if not long_enough:
        return []
    return [list(rng.choice(long_enough)[:length]) for _ in range(count)]


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _latency(fn, queries: list[list[int]], rounds: int = 5) -> dict[str, float]:
    samples = []
    clock = time.perf_counter_ns
    for _ in range(rounds):
        for q in queries:
            t0 = clock()
            fn(q)
            samples.append((clock() - t0) / 1000)
    return {"p50_us": round(_pct(samples, 0.5), 2), "p99_us": round(_pct(samples, 0.99), 2)}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _load(spec: dict) -> Workload:
    if spec["kind"] == "synthetic":
        return synthetic(spec["pairs"], spec["workers"])
    return mooncake(spec["trace"], spec["workers"])


def _query_sets(wl: Workload) -> dict[str, list[list[int]]]:
    rng = random.Random(11)
    return {
        "hit_128": _queries(wl, 128, 200),
        "hit_1024": _queries(wl, 1024, 50),
        "miss_128": [[rng.getrandbits(64) for _ in range(128)] for _ in range(200)],
    }


def run_kvctl(spec: dict) -> dict:
    wl = _load(spec)
    stores, removes = _events(wl)
    pairs = wl.pairs
    gc.collect()
    gc.disable()
    rss0 = _rss()
    index = KvIndex()
    t0 = time.perf_counter()
    for ev in stores:
        index.apply(ev)
    t_store = time.perf_counter() - t0
    rss_growth = _rss() - rss0
    stats = index.stats()
    held = stats[next(iter(stats))].blocks
    out: dict = {"pairs": held, "nodes": stats[next(iter(stats))].nodes,
                 "stored_blocks_per_s": round(pairs / t_store),
                 "rss_bytes_per_pair": round(rss_growth / held, 1)}
    for name, qs in _query_sets(wl).items():
        if qs:
            out[f"find_matches_{name}"] = _latency(index.find_matches, qs)
    victim = stores[0].worker_id
    t0 = time.perf_counter()
    removed = index.remove_worker(victim)
    out["remove_worker_ms"] = round((time.perf_counter() - t0) * 1000, 2)
    out["remove_worker_blocks"] = removed
    index = KvIndex()
    for ev in stores:
        index.apply(ev)
    t0 = time.perf_counter()
    for ev in removes:
        index.apply(ev)
    t_remove = time.perf_counter() - t0
    out["removed_blocks_per_s"] = round(pairs / t_remove)
    out["nodes_after_removing_everything"] = index.stats()[next(iter(index.stats()))].nodes
    gc.enable()
    del index, stores, removes
    gc.collect()
    # Traced from before the events exist, so the ints the index keeps from them are counted; the
    # events themselves are dropped before reading.
    tracemalloc.start()
    stores, _ = _events(wl)
    index = KvIndex()
    for ev in stores:
        index.apply(ev)
    del stores, _
    gc.collect()
    out["traced_bytes_per_pair"] = round(tracemalloc.get_traced_memory()[0] / held, 1)
    tracemalloc.stop()
    return out


def _dynamo_json(ev: RouterEvent) -> bytes:
    data = ev.data
    if type(data) is Stored:
        blocks = [{"block_hash": h, "tokens_hash": t} for h, t in zip(data.block_hashes, data.tokens_hashes,
                                                                        strict=True)]
        body = {"stored": {"parent_hash": data.parent_hash, "blocks": blocks}}
    else:
        body = {"removed": {"block_hashes": list(data.block_hashes)}}
    return json.dumps({"event_id": ev.event_id, "data": body, "dp_rank": ev.dp_rank}).encode()


def run_dynamo(spec: dict) -> dict:
    from dynamo._core import RadixTree  # the `oracle` extra

    wl = _load(spec)
    stores, removes = _events(wl)
    pairs = wl.pairs
    store_json = [(ev.worker_id, _dynamo_json(ev)) for ev in stores]
    remove_json = [(ev.worker_id, _dynamo_json(ev)) for ev in removes]
    del stores, removes
    gc.collect()
    gc.disable()
    rss0 = _rss()
    tree = RadixTree()
    t0 = time.perf_counter()
    for w, body in store_json:
        tree.apply_event(w, body)
    t_store = time.perf_counter() - t0
    out: dict = {"pairs": pairs, "stored_blocks_per_s": round(pairs / t_store),
                 "rss_bytes_per_pair": round((_rss() - rss0) / pairs, 1)}
    for name, qs in _query_sets(wl).items():
        if qs:
            out[f"find_matches_{name}"] = _latency(tree.find_matches, qs)
    t0 = time.perf_counter()
    tree.remove_worker(store_json[0][0])
    out["remove_worker_ms"] = round((time.perf_counter() - t0) * 1000, 2)
    tree = RadixTree()
    for w, body in store_json:
        tree.apply_event(w, body)
    t0 = time.perf_counter()
    for w, body in remove_json:
        tree.apply_event(w, body)
    out["removed_blocks_per_s"] = round(pairs / (time.perf_counter() - t0))
    gc.enable()
    return out


def _child(impl: str, spec: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", impl, json.dumps(spec)],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def _median(runs: list[dict]) -> dict:
    out: dict = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = _median([r[key] for r in runs])
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in runs)
        else:
            out[key] = value
    return out


def _ratios(ours: dict, theirs: dict) -> dict:
    """kvctl / Dynamo for throughputs (higher is better) and latencies/bytes (lower is better)."""
    out = {}
    for key in ("stored_blocks_per_s", "removed_blocks_per_s", "rss_bytes_per_pair", "remove_worker_ms"):
        if key in ours and key in theirs and theirs[key]:
            out[key] = round(ours[key] / theirs[key], 2)
    for key, value in ours.items():
        if isinstance(value, dict) and key in theirs:
            out[f"{key}_p50"] = round(value["p50_us"] / theirs[key]["p50_us"], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="100k pairs x 16 workers only")
    parser.add_argument("--repeat", type=int, default=3, help="runs per configuration (medians)")
    parser.add_argument("--no-oracle", action="store_true", help="skip Dynamo even if installed")
    parser.add_argument("--out", type=Path, help="also write every result to this JSON file")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        impl, spec = args.child[0], json.loads(args.child[1])
        print(json.dumps(run_kvctl(spec) if impl == "kvctl" else run_dynamo(spec)))
        return
    try:
        import dynamo._core  # noqa: F401

        oracle = not args.no_oracle
    except ImportError:
        oracle = False
    specs = [{"kind": "synthetic", "pairs": 100_000, "workers": 16}]
    if not args.quick:
        specs += [{"kind": "synthetic", "pairs": 100_000, "workers": 128},
                  {"kind": "synthetic", "pairs": 1_000_000, "workers": 16},
                  {"kind": "synthetic", "pairs": 1_000_000, "workers": 128},
                  {"kind": "mooncake", "trace": "conversation_trace.jsonl", "workers": 16},
                  {"kind": "mooncake", "trace": "synthetic_trace.jsonl", "workers": 16}]
    results = []
    for spec in specs:
        entry: dict = {"workload": spec, "kvctl": _median([_child("kvctl", spec) for _ in range(args.repeat)])}
        if oracle:
            entry["dynamo"] = _median([_child("dynamo", spec) for _ in range(args.repeat)])
            entry["kvctl_over_dynamo"] = _ratios(entry["kvctl"], entry["dynamo"])
        results.append(entry)
        print(json.dumps(entry), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"python": sys.version.split()[0], "repeat": args.repeat,
                                        "results": results}, indent=1))


if __name__ == "__main__":
    main()
