"""A restart's restore, in process: write a state dir's image of an index of N (worker, block) pairs, then time
restoring it into an empty fleet (what `kvctl serve` does after opening its port), medians of `--rounds`.

The workload is scale_bench's shape (64 workers, 256 shared prompts of 8-64 blocks, each request adding a
unique 8-64-block tail, an engine's first request for a prompt storing it from the root), built straight
into a fleet, so that the restore is measured without the processes, ports and engines around it (the
collector set up as `kvctl serve` sets it).

    python benchmarks/restore_bench.py [--pairs 1000000] [--rounds 3] [--profile restore.txt] [--serve]

Prints one JSON line: the image's size, the time to write it, and the restore's median and runs (wall; and
its median CPU time, steadier on a shared machine). With `--serve`, each round is a restart instead: `kvctl
serve` started on the state dir, timed until its port accepts and until `/readyz` says the index is whole,
and the CPU time it used until then.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's kvctl, before serve_bench imports one

import httpx  # noqa: E402
from _procs import Proc  # noqa: E402
from serve_bench import free_port, wait_until  # noqa: E402

from kvctl.core.events import RouterEvent, Stored  # noqa: E402
from kvctl.core.names import DEFAULT_MODEL  # noqa: E402
from kvctl.runtime import survivors_frozen  # noqa: E402
from kvctl.server.persistence import replay, snapshot  # noqa: E402
from kvctl.server.state import Fleet  # noqa: E402

PROMPTS = 256
PROMPT_BLOCKS = (8, 64)
TAIL_BLOCKS = (8, 64)


def _blocks(rng: random.Random, n: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(n)]


def build(pairs: int, workers: int, seed: int = 27) -> Fleet:
    """A fleet holding about `pairs` pairs, stored as scale_bench's engines store them."""
    rng = random.Random(seed)
    fleet = Fleet()
    prompts = [(_blocks(rng, n), _blocks(rng, n)) for n in (rng.randint(*PROMPT_BLOCKS) for _ in range(PROMPTS))]
    held: set[tuple[int, int]] = set()
    stored = i = 0
    while stored < pairs:
        w, p = i % workers, rng.randrange(PROMPTS)
        i += 1
        n = rng.randint(*TAIL_BLOCKS)
        hashes, locals_ = _blocks(rng, n), _blocks(rng, n)
        engine, local = prompts[p]
        if (w, p) in held:
            event = Stored(engine[-1], hashes, locals_)
        else:
            held.add((w, p))
            event = Stored(None, engine + hashes, local + locals_)
        stored += len(event.block_hashes)
        fleet.apply(DEFAULT_MODEL, [RouterEvent(w + 1, event, 0, i)], 0.0)
    return fleet


def restart(state_dir: Path) -> dict[str, float]:
    """`kvctl serve` on the state dir: seconds from its start until its port accepts, and until it is ready."""
    port = free_port()
    proc = Proc([sys.executable, "-m", "kvctl", "serve", "--listen", f"127.0.0.1:{port}", "--state-dir",
                 str(state_dir), "--snapshot-interval", "3600"])
    started = time.perf_counter()

    def port_open() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    def ready() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=30).status_code == 200
        except httpx.TransportError:
            return False

    try:
        opened = wait_until(port_open, 600, "port", proc)
        readied = wait_until(ready, 600, "/readyz 200", proc)
        cpu = cpu_s(proc.p.pid)
    finally:
        proc.stop()
    return {"port_open_s": opened - started, "ready_s": readied - started, "ready_cpu_s": cpu}


def cpu_s(pid: int) -> float:
    """CPU seconds a process has used (user and system): what a restart costs, however busy the machine is."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", type=Path, help="write a pyinstrument text profile of the last round here")
    ap.add_argument("--serve", action="store_true", help="time restarts of `kvctl serve` instead")
    args = ap.parse_args()
    fleet = build(args.pairs, args.workers)
    pairs = fleet.models[DEFAULT_MODEL].router.index.device.blocks
    with tempfile.TemporaryDirectory(prefix="restore_bench-") as tmp:
        state_dir = Path(tmp)
        t = time.perf_counter()
        path = snapshot.write(snapshot.capture(fleet, time.time()), state_dir)
        write_s = time.perf_counter() - t
        image_mb = round(path.stat().st_size / 1e6, 1)
        del fleet
        if args.serve:
            rounds = [restart(state_dir) for _ in range(args.rounds)]
            print(json.dumps({"pairs": pairs, "image_mb": image_mb, **{
                key: round(statistics.median(r[key] for r in rounds), 2) for key in rounds[0]},
                "runs": [{k: round(v, 2) for k, v in r.items()} for r in rounds]}))
            return
        runs, cpu = [], []
        for r in range(args.rounds):
            profiler = None
            if args.profile is not None and r == args.rounds - 1:
                from pyinstrument import Profiler  # noqa: PLC0415 (only when asked)
                profiler = Profiler()
                profiler.start()
            t, c = time.perf_counter(), time.process_time()
            with survivors_frozen():  # as `kvctl serve` restores
                restored = Fleet()
                done = replay.restore(restored, state_dir, time.monotonic())
            runs.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
            if profiler is not None:
                profiler.stop()
                args.profile.write_text(profiler.output_text(show_all=False))
            got = restored.models[DEFAULT_MODEL].router.index.device.blocks
            assert got == pairs and not done.problems, (got, pairs, done.problems)
            del restored
    print(json.dumps({"pairs": pairs, "image_mb": image_mb, "write_s": round(write_s, 2),
                      "restore_s": round(statistics.median(runs), 2), "restore_s_per_m": round(
                          statistics.median(runs) / pairs * 1e6, 2), "runs": [round(x, 2) for x in runs],
                      "restore_cpu_s": round(statistics.median(cpu), 2)}))


if __name__ == "__main__":
    main()
