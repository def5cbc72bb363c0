"""Issue 43, acceptance point 1: on the same engine byte streams (vLLM 0.34 and SGLang 0.5.23, written by the engines'
own code: tests/fixtures/engine-streams/), `kvctl serve` indexes exactly what Dynamo 1.6.1's standalone indexer
(`python -m dynamo.indexer --threads 1`) does: the same blocks per (worker, dp rank, tier), the same overlaps per
prompt (without and with the stream's cache salt and LoRA name), per tier as far as Dynamo's `/query` tells them,
and `kvctl tree diff` finds the two indexes equal.

One case per stream, each with an indexer and a `kvctl serve` of its own: a stream's workers are w0..w2 in every
file, and a pair per case keeps one stream's differences out of the next one's diff (Dynamo's indexer is up in
a fraction of a second; the pair costs little more than kvctl's start). Both follow one XPUB per (worker, dp
rank) publisher, and nothing is published before both have subscribed on every socket (tests/interop/
engine_streams.py). After each worker's last message (its sentinel: a plain one-block store), the test waits,
without sleeping, until Dynamo's dump holds that sentinel and kvctl has applied that last seq (by its
`/v1/status`, not by the sentinel: a worker whose sentinel kvctl wrongly dropped still ends the wait, and shows
as a difference); everything is compared before anything is asserted, so a failure shows every difference of
the stream at once. A stream that passes prints its tables too (`pytest -rP`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httpx
import pytest

from tests.commands.live_router import kvctl
from tests.interop.engine_streams import (
    Blocks,
    Key,
    Publishers,
    Stream,
    blocks_of,
    dynamo_dump,
    dynamo_overlaps,
    key_name,
    kvctl_dump,
    kvctl_overlaps,
    kvctl_settled,
    load_stream,
    stream_files,
    table,
)
from tests.interop.fleet import NAMESPACE, START_S, Fleet, Proc, Router, free_port, wait_until

pytestmark = pytest.mark.interop

SUBSCRIBERS = 2
"""On every publisher socket: Dynamo's indexer and kvctl."""


@pytest.fixture(params=stream_files(), ids=lambda p: p.stem)
def stream(request: pytest.FixtureRequest) -> Stream:
    return load_stream(request.param)


@pytest.fixture
def publishers(stream: Stream) -> Iterator[Publishers]:
    pubs = Publishers(stream.keys)
    yield pubs
    pubs.close()


@pytest.fixture
def pair(dynamo: Path, stream: Stream, publishers: Publishers, tmp_path: Path) -> Iterator[tuple[Fleet, Router]]:
    """Dynamo's indexer and `kvctl serve` on the stream's publishers (a `Fleet` with neither mockers nor frontend,
    for its process handling), both subscribed on every socket; stopped by their pids after the test."""
    fleet = Fleet(workdir=tmp_path, python=dynamo, nats_url=None, namespace=NAMESPACE, model_dir=tmp_path / "model")
    (tmp_path / "home").mkdir()
    endpoints = publishers.endpoints()
    try:
        port = free_port()
        workers = ",".join(f"{wid}:{dp}={endpoint}" for (wid, dp), endpoint in endpoints.items())
        argv = [str(dynamo), "-m", "dynamo.indexer", "--workers", workers, "--block-size", "16", "--threads", "1",
                "--port", str(port)]
        fleet.indexer = Proc("indexer", argv, tmp_path / "indexer.log", fleet.env())
        fleet.indexer_url = f"http://127.0.0.1:{port}"
        router = fleet.start_router(
            "kvctl", *(a for (wid, dp), endpoint in endpoints.items() for a in ("--worker", f"{wid}:{dp}={endpoint}")))
        fleet.await_indexer()
        fleet.await_router(router)
        try:
            wait_until(lambda: publishers.joined(SUBSCRIBERS), "both subscribers joined on every publisher socket",
                       timeout=START_S, procs=fleet.procs)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{publishers.state()}") from None
        yield fleet, router
    finally:
        fleet.stop()


def test_kvctl_indexes_the_engine_stream_as_dynamo_s_indexer_does(stream: Stream, publishers: Publishers,
                                                                   pair: tuple[Fleet, Router]) -> None:
    fleet, router = pair
    assert fleet.indexer_url is not None
    sentinels, last_seq = stream.sentinels(), stream.last_seq()

    def dynamo_holds(key: Key) -> bool:
        held = blocks_of(dynamo_dump(fleet.indexer_url))  # type: ignore[arg-type]
        return sentinels[key] in held.get((*key, "device"), [])

    def kvctl_applied(key: Key) -> bool:
        return kvctl_settled(httpx.get(f"{router.url}/v1/status", timeout=5).json(), {key: last_seq[key]})

    def both_sides() -> str:
        return (f"Dynamo's dump: {_brief(blocks_of(dynamo_dump(fleet.indexer_url)))}\n"  # type: ignore[arg-type]
                f"kvctl's tree: {_brief(blocks_of(kvctl_dump(router.url)))}\n"
                f"kvctl's streams: {_streams(router.url)}\nsentinels: "
                + ", ".join(f"{key_name(k)} {h}" for k, h in sentinels.items()))

    # Every message in file order; after a publisher's last one (its sentinel), until both sides applied it, so
    # that both apply the workers' events in file order. The order across workers matters: they share the tree,
    # and where two workers store the same tokens under different engine hashes (v1's w0 and lookahead w2), the
    # one that stores them second cannot remove them by its own hashes (Dynamo: `block_not_found`). Published
    # all at once, Dynamo's per-worker listeners interleave the workers as they please: v1 gave 19/19/20 blocks
    # in one run and 20/19/18 in another.
    for message in stream.messages:
        publishers.send(message)
        if message.seq != last_seq[message.key]:
            continue
        try:
            wait_until(partial(dynamo_holds, message.key),
                       f"{stream.name}: Dynamo's indexer holding {key_name(message.key)}'s sentinel "
                       f"{sentinels[message.key]}", timeout=START_S, procs=fleet.procs)
            wait_until(partial(kvctl_applied, message.key),
                       f"{stream.name}: kvctl applying {key_name(message.key)}'s last seq {message.seq}",
                       timeout=START_S, procs=fleet.procs)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{both_sides()}") from None

    differences: list[str] = []
    report: list[str] = []

    # Blocks per (worker, dp rank, tier): counted, not compared by engine hash, since a dump names a block several
    # workers hold by one engine hash (`Blocks`); which blocks differ, by their place in the tree, is the tree
    # diff's to say.
    theirs, ours = blocks_of(dynamo_dump(fleet.indexer_url)), blocks_of(kvctl_dump(router.url))
    rows = []
    for wid, dp, tier in sorted(set(theirs) | set(ours) | {(*k, "device") for k in stream.keys}):
        a, b = len(theirs.get((wid, dp, tier), ())), len(ours.get((wid, dp, tier), ()))
        mark = "" if a == b else "<< differs"
        if mark:
            differences.append(f"blocks on {wid}:{dp} {tier} (Dynamo {a}, kvctl {b})")
        rows.append((f"{wid}:{dp}", tier, str(a), str(b), mark))
    report.append("blocks per worker:dp and tier\n" + table(rows, ("worker", "tier", "Dynamo", "kvctl", "")))
    for key, h in sentinels.items():
        if h not in ours.get((*key, "device"), []):
            report.append(f"kvctl does not hold {key_name(key)}'s sentinel block {h} on device")

    # Overlaps per prompt: device, through host, through disk and external (cumulative, in blocks).
    rows, refused, overlaps_differ = [], {}, 0
    for prompt in stream.prompts():
        dyn, _ = dynamo_overlaps(fleet.indexer_url, prompt, stream.keys)
        kv, _ = kvctl_overlaps(router.url, prompt, stream.keys)
        if isinstance(kv, str):
            refused[prompt.label] = kv
        for key in stream.keys:
            got = kv.split(" {")[0] if isinstance(kv, str) else "/".join(map(str, kv[key]))
            want = "/".join(map(str, dyn[key]))
            mark = "" if got == want else "<< differs"
            overlaps_differ += bool(mark)
            rows.append((prompt.label, key_name(key), want, got, mark))
    report.append("overlap blocks per prompt: device/+host/+disk&external (cumulative, as Dynamo's /query gives them)\n"
                  + table(rows, ("prompt", "worker", "Dynamo", "kvctl", "")))
    if overlaps_differ:
        differences.append(f"overlaps in {overlaps_differ} of {len(rows)} (prompt, worker) rows")
    if refused:
        report.append("kvctl's /v1/route refused:\n" + "\n".join(f"  {k}: {v}" for k, v in refused.items()))

    # kvctl's own diff of the two indexes.
    diff = kvctl(router.url, "tree", "diff", "--exit-code", "-o", "json", router.url, f"dynamo+{fleet.indexer_url}")
    try:
        equal = json.loads(diff.stdout).get("equal")
    except ValueError:
        equal = None
    if diff.exit_code != 0 or equal is not True:
        differences.append(f"kvctl tree diff (exit {diff.exit_code}, equal {equal})")
        report.append(f"kvctl tree diff (exit {diff.exit_code}):\n{diff.output.strip()}")

    # Doctor on what kvctl followed: it names what each stream publishes that Dynamo does not index, and never
    # blames the engines' hashing for a salted, Mamba or EAGLE store.
    verdict = kvctl(router.url, "doctor", "-o", "json")
    findings = {f["check"]: f for f in json.loads(verdict.stdout)["findings"]}
    hashing = findings.get("hashing", {})
    lookahead = "lookahead" in json.dumps(hashing.get("evidence", {}).get("why"))
    if hashing.get("severity") != ("WARNING" if stream.name.startswith("v1") else "OK") or lookahead != (
            stream.name.startswith("v1")):  # v1's w2 hashes with a lookahead token: by design, and named so
        differences.append(f"doctor's hashing check: {hashing}")
    named = DOCTOR_NAMES.get(stream.name.split("_")[0])
    if named is not None and findings.get(named, {}).get("severity") != "OK":
        differences.append(f"doctor does not name {named!r} as Dynamo's design: {findings.get(named)}")
    report.append("doctor: " + ", ".join(f"{c} {f['severity']}" for c, f in sorted(findings.items())))

    print("\n\n".join(report))  # shown by `pytest -rP` for a stream that passes
    assert not differences, (f"{stream.name}: kvctl differs from Dynamo 1.6.1's indexer: "
                             + "; ".join(differences) + "\n\n" + "\n\n".join(report))


DOCTOR_NAMES = {"v2": "groups", "v3": "groups", "v4": "groups", "v5": "dropped", "v6": "dropped", "s2": "salts",
                "s3": "salts", "s4": "eagle"}
"""The doctor check that names what each stream (by its file's prefix) publishes that Dynamo does not index."""


def _brief(blocks: Blocks) -> str:
    return ", ".join(f"{key_name(k[:2])} {k[2]} {len(v)}" for k, v in sorted(blocks.items())) or "(nothing)"


def _streams(url: str) -> str:
    status = httpx.get(f"{url}/v1/status", timeout=5).json()
    return "; ".join(f"{s['worker']['worker_id']}:{s['worker']['dp_rank']} last_seq {s['last_seq']} "
                     f"batches {s['batches_applied']} errors {s['decode_errors']}" for s in status["streams"]) + \
        f"; queues {status.get('queues')}"

