"""The C extension against its pure-Python twin, on the three hot paths it serves, 4096-token prompts each:

- hash: a prompt's local block hashes (block size 16, 256 blocks) and their sequence hashes;
- event: decoding a vLLM batch holding the BlockStored event of that prompt (token ids hashed as they come);
- route: reading a route request's JSON (`read_route_body`, as `POST /v1/route` does).

Each path runs in a subprocess of its own, picked the way an install picks it (`KVCTL_PURE_PYTHON=1` for the
twin); each figure is the median over `--repeat` rounds of the mean of `--number` calls.

    python benchmarks/native_bench.py [--repeat 15] [--number 200]

Prints one JSON line: microseconds per call on each path, and the ratio python / C.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOKENS, BLOCK = 4096, 16


def _workloads() -> dict[str, object]:
    """name: a call to time, on inputs made before timing."""
    from array import array

    from serve_bench import payload, stored_event

    from kvctl.core.events import decode_engine_batch
    from kvctl.core.hashing import packed_block_hashes, sequence_hashes
    from kvctl.server.api import read_route_body

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


def _measure(repeat: int, number: int) -> dict[str, float]:
    from kvctl.core import native

    out = {"implementation": native.IMPLEMENTATION}
    for name, call in _workloads().items():
        rounds = timeit.repeat(call, repeat=repeat, number=number)
        out[name] = round(statistics.median(rounds) / number * 1e6, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--number", type=int, default=200)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(args.repeat, args.number)))
        return
    results = {}
    for path, pure in (("c", ""), ("python", "1")):
        env = {k: v for k, v in os.environ.items() if k != "KVCTL_PURE_PYTHON"}
        if pure:
            env["KVCTL_PURE_PYTHON"] = pure
        cmd = [sys.executable, __file__, "--child", "--repeat", str(args.repeat), "--number", str(args.number)]
        results[path] = json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout)
    ratios = {k: round(results["python"][k] / results["c"][k], 2) for k in ("hash", "event", "route")}
    print(json.dumps({"us_per_call": results, "python_over_c": ratios}))


if __name__ == "__main__":
    main()
