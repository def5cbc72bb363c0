"""Soak: a `kvctl serve` under steady engine churn and routing load for a long time, sampled every window.

Two phases, each against a fresh router process:

- events: E engines (ZMQ PUB sockets speaking vLLM's wire format) each hold a system prompt and a ring of
  R request slots; every step frees the oldest request's blocks (BlockRemoved) and stores a new one under
  the prompt (BlockStored), batched as vLLM batches a step's events. The engines' caches are bounded, so
  the index must reach a steady state and stay there: same nodes, same pairs, flat RSS. Meanwhile a
  separate process routes 2048-token requests (a system prompt plus fresh tokens) over keep-alive HTTP.
- approximate: a router with `--approximate --max-tree-size CAP` (no KV events: it indexes the requests it
  reserves) takes routes with unique prompts, each reserved then freed, so its tree fills to the cap and is
  pruned from then on.

Every window: server RSS (its process tree), index pairs and nodes (`/v1/tree/stats`), achieved events/s
and routes/s, route p50/p99 of that window, and the loss counters of `/v1/status` (gaps, lost batches,
decode errors, writer drops). The verdict, per phase, compares the first window after warm-up with the
last one:

- rss_bounded: RSS end <= RSS start x 1.10 + 8 MiB;
- nodes_flat (events): nodes end <= nodes start x 1.01 (the engines' rings hold a constant set);
  under_cap (approximate): pairs <= the cap in every window;
- p99_stable: p99 end <= 2 x p99 start + 1 ms;
- nothing_lost (events): no gap, lost batch, decode error or dropped batch, and every event sent applied.

Rates are targets: what the machine achieved is printed beside them, never assumed.

    python benchmarks/soak.py [--duration 600] [--events-per-s 50000] [--routes-per-s 1000] [--engines 8]
                              [--phases events,approximate] [--window 10]

One JSON line per window, then a summary line; exit 1 if a criterion fails.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from typing import Any

import httpx
import msgspec
from _keepalive import KeepAlive  # noqa: E402
from _procs import Proc, rss_bytes  # noqa: E402
from serve_bench import Publishers  # noqa: E402

BLOCK = 16
PROMPT_BLOCKS = 32
REQUEST_BLOCKS = 2  # blocks a request stores beyond its prompt (one BlockStored event)
QUERY_TOKENS = 2048
ENC = msgspec.msgpack.Encoder()


# ----- engines ------------------------------------------------------------------------------------------

class Engines:
    """E PUB sockets (serve_bench's publishers), each with a prompt and a ring of request slots; a step frees
    the oldest request and stores a new one: all hashes unique to their (engine, generation)."""

    def __init__(self, engines: int, slots: int, events_per_batch: int) -> None:
        self.pubs = Publishers(engines)
        self.slots = slots
        self.per_batch = max(2, events_per_batch - events_per_batch % 2)
        self.generation = [0] * engines
        self.rings: list[list[list[int] | None]] = [[None] * slots for _ in range(engines)]
        self.prompt_tokens = [[(e * 7919 + i) % 30_000 + 1 for i in range(PROMPT_BLOCKS * BLOCK)]
                              for e in range(engines)]
        self.prompt_hashes = [[(e + 1) << 40 | i for i in range(PROMPT_BLOCKS)] for e in range(engines)]
        self.events_sent = 0

    def endpoints(self) -> list[str]:
        return self.pubs.endpoints()

    def _send(self, e: int, events: list[dict[str, Any]]) -> None:
        self.pubs.send(e, ENC.encode([time.time(), events, 0]))
        self.events_sent += len(events)

    def hello(self) -> None:
        """Every engine (re)stores its prompt: the slow-joiner probe, repeated until the router has it."""
        for e in range(len(self.prompt_tokens)):
            self._send(e, [_stored(self.prompt_hashes[e], None, self.prompt_tokens[e])])

    def batch(self, e: int) -> None:
        """One engine step: per_batch/2 requests replaced."""
        events: list[dict[str, Any]] = []
        ring = self.rings[e]
        parent = self.prompt_hashes[e][-1]
        for _ in range(self.per_batch // 2):
            g = self.generation[e]
            self.generation[e] += 1
            slot = g % self.slots
            old = ring[slot]
            if old is not None:
                events.append({"type": "BlockRemoved", "block_hashes": old[::-1], "medium": "GPU"})
            hashes = [(e + 1) << 40 | 1 << 39 | (g * REQUEST_BLOCKS + k) for k in range(REQUEST_BLOCKS)]
            tokens = [(g * 31 + k * 17 + e) % 30_000 + 1 for k in range(REQUEST_BLOCKS * BLOCK)]
            events.append(_stored(hashes, parent, tokens))
            ring[slot] = hashes
        self._send(e, events)

    def held_pairs(self) -> int:
        return sum(PROMPT_BLOCKS + REQUEST_BLOCKS * sum(1 for s in ring if s is not None) for ring in self.rings)

    def close(self) -> None:
        self.pubs.close()


def _stored(hashes: list[int], parent: int | None, tokens: list[int]) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BLOCK, "lora_id": None, "medium": "GPU"}


# ----- the route client (its own process, so its latencies are not the event generator's) ------------------

def route_client(url: str, rate: float, prompts: list[list[int]], unique: bool, window: float,
                 out: Any, stop: Any, cid: int = 0) -> None:
    """One of the route clients: `rate` requests/s over one keep-alive connection, latencies per window.

    The client costs the host little, as the router shares it: fresh tokens are drawn once, bodies are
    encoded by msgspec, and requests go over `_keepalive` (tens of microseconds each, where httpx's
    several hundred held a 2-core host under 800 routes/s beside 50k events/s).
    """
    rng = random.Random(11 + cid)
    suffixes = [[rng.randrange(1, 30_000) for _ in range(QUERY_TOKENS)] for _ in range(64)]
    encode = msgspec.json.Encoder().encode
    client = KeepAlive(url)
    if client.request("GET", "/healthz")[0] != 200:
        raise RuntimeError(f"{url}/healthz is not 200")
    out.put("ready")  # the soak's clock starts now: its windows and this client's are the same windows
    period = 1.0 / rate
    lat: list[float] = []
    errors = 0
    window_end = time.perf_counter() + window
    windows = 0
    next_at = time.perf_counter()
    n = 0
    parent = os.getppid()
    while not stop.is_set() and os.getppid() == parent:  # a killed soak must not leave its client running
        now = time.perf_counter()
        if now >= window_end:
            out.put((windows, lat, errors))
            windows += 1
            lat, errors = [], 0
            window_end += window
        if now < next_at:
            time.sleep(min(next_at - now, 0.01))
            continue
        next_at += period
        if next_at < now - 1.0:  # fell behind by more than a second: do not burst to catch up
            next_at = now
        n += 1
        prompt = prompts[n % len(prompts)]
        fresh = suffixes[n % len(suffixes)][:QUERY_TOKENS - len(prompt)]
        request_id = f"soak-{cid}-{n}"
        if unique:  # a prompt no other request had: its blocks are new to the index
            fresh[0], fresh[1], fresh[2] = n % 30_000 + 1, n // 30_000 % 30_000 + 1, cid + 1
        body: dict[str, Any] = {"token_ids": prompt + fresh}
        if unique:  # approximate mode learns from reservations: reserve, then free once answered
            body |= {"request_id": request_id, "reserve": True}
        started = time.perf_counter()
        try:
            status, _ = client.request("POST", "/v1/route", encode(body))
            lat.append(time.perf_counter() - started)
            if status != 200 or (unique and client.request("DELETE", f"/v1/requests/{request_id}")[0] != 200):
                errors += 1
        except OSError:  # a broken connection: counted, and the next request opens another
            errors += 1
            client.close()
            client = KeepAlive(url)
    client.close()


# ----- one phase ------------------------------------------------------------------------------------------

def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 3)


def _serve(args: list[str], state_dir: str) -> tuple[Proc, httpx.Client]:
    proc = Proc([sys.executable, "-m", "kvctl", "serve", "--listen", "127.0.0.1:0", "--state-dir", state_dir,
                 "--no-restore", "--snapshot-interval", "86400", *args])
    if not proc.first.wait(60):
        raise RuntimeError(f"kvctl serve printed no URL: {proc.tail()}")
    return proc, httpx.Client(base_url=proc.first_line.strip(), timeout=30)


def _loss(status: dict[str, Any]) -> dict[str, int]:
    streams = status["streams"]
    return {"gaps": sum(s["gaps"] for s in streams), "lost_batches": sum(s["lost_batches"] for s in streams),
            "decode_errors": sum(sum(s["decode_errors"].values()) for s in streams),
            "dropped_batches": sum(q["dropped_batches"] for q in status["queues"])}


def run_phase(phase: str, a: argparse.Namespace) -> dict[str, Any]:
    tmp = tempfile.TemporaryDirectory(prefix="soak-")
    engines = None
    if phase == "events":
        per_engine = a.events_per_s / a.engines
        batches_per_s = max(1.0, per_engine / a.events_per_batch)
        engines = Engines(a.engines, a.slots, int(per_engine / batches_per_s))
        argv = [arg for e, ep in enumerate(engines.endpoints()) for arg in ("--worker", f"{e + 1}:0={ep}")]
        prompts = engines.prompt_tokens
    else:
        argv = ["--approximate", "--max-tree-size", str(a.max_tree_size), "--router-ttl", str(a.router_ttl)]
        prompts = [[(p * 7919 + i) % 30_000 + 1 for i in range(PROMPT_BLOCKS * BLOCK)] for p in range(a.engines)]
    proc, http = _serve(argv, tmp.name)
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    clients: list[Any] = []
    rows: list[dict[str, Any]] = []
    reports: dict[int, list[tuple[list[float], int]]] = {}  # window -> each client's (latencies, errors)
    try:
        if engines is None:  # no engines, no events: workers are registered, the router indexes its decisions
            for e in range(a.engines):
                http.post("/v1/workers", json={"worker_id": e + 1}).raise_for_status()
        else:
            deadline = time.monotonic() + 30
            while _pairs(http) < engines.held_pairs():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"engines not subscribed: {http.get('/v1/status').text[:400]}")
                engines.hello()
                time.sleep(0.05)
            sent_at_start = engines.events_sent
        clients = [ctx.Process(target=route_client, args=(proc.first_line.strip(), a.routes_per_s / a.route_clients,
                                                          prompts, phase == "approximate", a.window, out, stop, c),
                               daemon=True) for c in range(a.route_clients)]
        for client in clients:
            client.start()
        if [out.get(timeout=120) for _ in clients] != ["ready"] * len(clients):
            raise RuntimeError("the route clients did not start")
        t0 = time.perf_counter()
        next_window = t0 + a.window
        sent_mark = engines.events_sent if engines is not None else 0
        step = 0
        windows = max(1, round(a.duration / a.window))
        while len(rows) < windows:  # every window is sampled, however late the client's report of it comes
            now = time.perf_counter()
            if engines is not None:
                # engine steps paced to the event target: how many batches should have gone by now
                due = int((now - t0) * a.events_per_s / engines.per_batch)
                while step < due and time.perf_counter() - now < 0.05:
                    engines.batch(step % a.engines)
                    step += 1
            if now >= next_window:
                while len(reports.get(len(rows), [])) < len(clients):  # this window from every client
                    w, more, more_errors = out.get(timeout=30)
                    reports.setdefault(w, []).append((more, more_errors))
                lat = [x for more, _ in reports[len(rows)] for x in more]
                errors = sum(more_errors for _, more_errors in reports.pop(len(rows)))
                rows.append(_sample(phase, http, proc, now - t0, lat, errors, a.window,
                                    (engines.events_sent - sent_mark) if engines is not None else 0))
                sent_mark = engines.events_sent if engines is not None else 0
                print(json.dumps(rows[-1]), flush=True)
                next_window += a.window
            elif engines is None or step >= due:
                time.sleep(0.002)
        stop.set()
        for client in clients:
            client.join(30)
        summary = _verdict(phase, rows, a)
        if engines is not None:  # every event sent is in: the index equals the engines' caches
            sent = engines.events_sent - sent_at_start
            deadline = time.monotonic() + 60
            while _pairs(http) != engines.held_pairs() and time.monotonic() < deadline:
                time.sleep(0.1)
            loss = _loss(http.get("/v1/status").json())
            summary["events_sent"] = sent
            summary["pairs_expected"] = engines.held_pairs()
            summary["pairs_held"] = _pairs(http)
            summary["loss"] = loss
            summary["checks"]["nothing_lost"] = (summary["pairs_held"] == summary["pairs_expected"]
                                                 and not any(loss.values()))
        summary["ok"] = all(summary["checks"].values())
        return summary
    finally:
        stop.set()
        for client in clients:
            if client.is_alive():
                client.terminate()
        http.close()
        proc.stop()
        if engines is not None:
            engines.close()
        tmp.cleanup()


def _pairs(http: httpx.Client) -> int:
    model = http.get("/v1/tree/stats").json()["models"].get("default")
    return sum(model["workers"].values()) if model else 0


def _sample(phase: str, http: httpx.Client, proc: Proc, t: float, lat: list[float], errors: int, window: float,
            events: int) -> dict[str, Any]:
    stats = http.get("/v1/tree/stats").json()["models"].get("default") or {"workers": {}, "nodes": 0}
    status = http.get("/v1/status").json()
    return {"phase": phase, "t_s": round(t, 1), "rss_mib": round(rss_bytes(proc.p.pid) / 2**20, 1),
            "pairs": sum(stats["workers"].values()), "nodes": stats["nodes"],
            "events_per_s": round(events / window), "routes_per_s": round(len(lat) / window, 1),
            "route_errors": errors, "route_p50_ms": _pct(lat, 0.5), "route_p99_ms": _pct(lat, 0.99),
            "loss": _loss(status) if phase == "events" else None}


def _verdict(phase: str, rows: list[dict[str, Any]], a: argparse.Namespace) -> dict[str, Any]:
    """First window after warm-up (the second one) against the last."""
    first, last = rows[1], rows[-1]
    body = rows[1:]
    checks = {
        "rss_bounded": last["rss_mib"] <= first["rss_mib"] * 1.10 + 8,
        "p99_stable": (last["route_p99_ms"] or 0) <= 2 * (first["route_p99_ms"] or 0) + 1,
        "routes_answered": all(r["route_errors"] == 0 for r in body),
    }
    if phase == "events":
        checks["nodes_flat"] = last["nodes"] <= first["nodes"] * 1.01
    else:
        checks["under_cap"] = all(r["pairs"] <= a.max_tree_size for r in rows)
    return {"phase": phase, "duration_s": a.duration, "windows": len(rows),
            "rss_start_mib": first["rss_mib"], "rss_end_mib": last["rss_mib"],
            "nodes_start": first["nodes"], "nodes_end": last["nodes"],
            "pairs_start": first["pairs"], "pairs_end": last["pairs"],
            "p99_start_ms": first["route_p99_ms"], "p99_end_ms": last["route_p99_ms"],
            "p50_start_ms": first["route_p50_ms"], "p50_end_ms": last["route_p50_ms"],
            "events_per_s_target": a.events_per_s if phase == "events" else 0,
            "events_per_s_achieved": round(sum(r["events_per_s"] for r in body) / len(body)),
            "routes_per_s_target": a.routes_per_s,
            "routes_per_s_achieved": round(sum(r["routes_per_s"] for r in body) / len(body), 1),
            "checks": checks}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds per phase (default 600)")
    ap.add_argument("--events-per-s", type=float, default=50_000.0)
    ap.add_argument("--routes-per-s", type=float, default=1000.0)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--slots", type=int, default=2000, help="requests each engine's cache holds (default 2000)")
    ap.add_argument("--events-per-batch", type=int, default=100, help="events per engine step (default 100)")
    ap.add_argument("--max-tree-size", type=int, default=50_000, help="approximate phase: the cap (pairs)")
    ap.add_argument("--router-ttl", type=float, default=120.0, help="approximate phase: block TTL (s)")
    ap.add_argument("--window", type=float, default=10.0, help="seconds per sample (default 10)")
    ap.add_argument("--route-clients", type=int, default=2,
                    help="processes sharing the route rate, one keep-alive connection each (default 2)")
    ap.add_argument("--phases", default="events,approximate")
    a = ap.parse_args(argv)
    if round(a.duration / a.window) < 3:
        ap.error("--duration must cover at least 3 windows (a warm-up, a first and a last)")
    results = [run_phase(phase, a) for phase in a.phases.split(",")]
    summary = {"summary": results, "cpus": os.cpu_count(), "ok": all(r["ok"] for r in results)}
    print(json.dumps(summary), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
