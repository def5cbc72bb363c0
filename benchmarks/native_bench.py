"""The C extension against its pure-Python twin, on the three hot paths it serves, 4096-token prompts each:

- hash: a prompt's local block hashes (block size 16, 256 blocks) and their sequence hashes;
- event: decoding a vLLM batch holding the BlockStored event of that prompt (token ids hashed as they come);
- route: reading a route request's JSON (`read_route_body`, as `POST /v1/route` does).

The implementations take turns, round after round, in one process (swapped under `kvctl.core.native` as the
tests' `native_impl` fixture does): on a shared machine, timing one after the other measured its drift more
than their difference. Each figure is the median over `--repeat` rounds of the mean of `--number` calls.

    python benchmarks/native_bench.py [--repeat 21] [--number 100]

Prints one JSON line: microseconds per call on each path, and the ratio python / C.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import timeit
from array import array
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serve_bench import payload, stored_event  # noqa: E402

from kvctl.core import _native, _native_py, native  # noqa: E402
from kvctl.core.events import decode_engine_batch  # noqa: E402
from kvctl.core.hashing import packed_block_hashes, sequence_hashes  # noqa: E402
from kvctl.server.http.bodies import read_route_body  # noqa: E402

TOKENS, BLOCK = 4096, 16
IMPLEMENTATIONS = {"c": _native, "python": _native_py}


def _workloads() -> dict[str, Callable[[], object]]:
    """name: a call to time, on inputs made before timing."""
    rng = random.Random(23)
    tokens = [rng.randrange(200_000) for _ in range(TOKENS)]
    packed = array("I", tokens)
    batch = payload([stored_event(list(range(1, TOKENS // BLOCK + 1)), None, tokens)], 1.0)
    route = json.dumps({"token_ids": tokens, "model": "m"}).encode()
    return {
        "hash": lambda: sequence_hashes(packed_block_hashes(packed, BLOCK)),
        "event": lambda: decode_engine_batch(batch),
        "route": lambda: read_route_body(route),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=21)
    parser.add_argument("--number", type=int, default=100)
    args = parser.parse_args()
    workloads = _workloads()
    rounds: dict[str, dict[str, list[float]]] = {impl: {w: [] for w in workloads} for impl in IMPLEMENTATIONS}
    for _ in range(args.repeat):
        for impl, module in IMPLEMENTATIONS.items():
            for name in native.FUNCTIONS:
                setattr(native, name, getattr(module, name))
            for work, call in workloads.items():
                rounds[impl][work].append(timeit.timeit(call, number=args.number) / args.number * 1e6)
    us = {impl: {w: round(statistics.median(t), 1) for w, t in times.items()} for impl, times in rounds.items()}
    ratios = {w: round(us["python"][w] / us["c"][w], 1) for w in workloads}
    print(json.dumps({"us_per_call": us, "python_over_c": ratios}))


if __name__ == "__main__":
    main()
