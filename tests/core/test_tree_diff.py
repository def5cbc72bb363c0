"""tree_diff compares content, not shape: re-chunked, re-numbered, re-hashed dumps of the same blocks are
equal, and one block taken from one worker is named exactly. Also the stats and the drawn outline."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from xxhash import xxh3_64_intdigest

from kvctl.core.events import Removed, RouterEvent, Stored, Tier
from kvctl.core.events.dump_file import read_router_events
from kvctl.core.hashing import sequence_hashes
from kvctl.core.names import WorkerKey
from kvctl.core.tree_diff import diff_events, index_content, outline, tree_stats
from tests.fixtures_path import FIXTURES

Path = tuple[int, ...]

ALPHABET = (3, 2**63 + 11, 2**64 - 1)  # few symbols: prefixes are shared across workers
WORKERS = [(1, 0), (2, 0), (2, 1), (2**63 + 7, 0)]
FIXTURE = read_router_events((FIXTURES / "dynamo-1.6.1" / "dump.jsonl").read_text())


def engine_hash(path: Path, salt: int) -> int:
    """A block's engine hash: a function of its path, different per `salt` (another engine, another dump)."""
    return xxh3_64_intdigest(b"".join(h.to_bytes(8, "little") for h in path), seed=salt)


def stores(worker: WorkerKey, sequence: Path, cuts: list[int], salt: int) -> list[RouterEvent]:
    """`sequence` stored from the root as a chain of Storeds, split at `cuts`."""
    events = []
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(sequence)}), len(sequence)]
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        parent = engine_hash(sequence[:lo], salt) if lo else None
        hashes = [engine_hash(sequence[: i + 1], salt) for i in range(lo, hi)]
        events.append(RouterEvent(worker[0], Stored(parent, hashes, list(sequence[lo:hi])), worker[1]))
    return events


sequences = st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=7).map(tuple)
contents = st.dictionaries(st.sampled_from(WORKERS), st.lists(sequences, min_size=1, max_size=5), min_size=1)


def as_stream(content: dict[WorkerKey, list[Path]], salt: int, rng: random.Random) -> list[RouterEvent]:
    """The content as raw events, each sequence chunked at random, in a shuffled worker order, renumbered."""
    events = [e for w, seqs in content.items() for seq in seqs
              for e in stores(w, seq, rng.sample(range(1, 8), rng.randint(0, 3)), salt)]
    by_worker: dict[WorkerKey, list[RouterEvent]] = {}
    for e in events:
        by_worker.setdefault(e.worker, []).append(e)
    order = list(by_worker)
    rng.shuffle(order)
    merged = [e for w in order for e in by_worker[w]]
    return [RouterEvent(e.worker_id, e.data, e.dp_rank, 1000 + n) for n, e in enumerate(merged)]


@settings(max_examples=150, deadline=None)
@given(contents, st.randoms(use_true_random=False))
def test_the_same_content_rechunked_and_rehashed_is_equal(content: dict[WorkerKey, list[Path]],
                                                          rng: random.Random) -> None:
    dump = index_content(as_stream(content, 1, rng)).index.dump()  # a dump: one Stored per edge
    other = as_stream(content, 2, rng)  # raw chained stores, other engine hashes and event ids
    diff = diff_events(dump, other)
    assert diff.equal, diff.to_dict()
    assert {w["worker"] for w in diff.summary()} == {f"{w}:{d}" for w, d in content}


@settings(max_examples=150, deadline=None)
@given(contents, st.randoms(use_true_random=False), st.data())
def test_one_removed_block_is_named_exactly(content: dict[WorkerKey, list[Path]], rng: random.Random,
                                            data: st.DataObject) -> None:
    worker = data.draw(st.sampled_from(sorted(content)))
    held = {seq[:i] for seq in content[worker] for i in range(1, len(seq) + 1)}
    leaves = sorted(p for p in held if not any(len(q) > len(p) and q[: len(p)] == p for q in held))
    leaf = data.draw(st.sampled_from(leaves))
    stream = as_stream(content, 1, rng)
    trimmed = [*stream, RouterEvent(worker[0], Removed([engine_hash(leaf, 1)]), worker[1])]
    diff = diff_events(stream, trimmed)
    assert not diff.equal
    assert [(w["worker"], w["only_a"], w["only_b"]) for w in diff.summary() if w["only_a"] or w["only_b"]] == [
        (f"{worker[0]}:{worker[1]}", 1, 0)]
    (block,) = diff.details("a")
    assert (block["worker_id"], block["dp_rank"], block["tier"]) == (worker[0], worker[1], "device")
    assert (block["depth"], block["local_hash"]) == (len(leaf), leaf[-1])
    assert block["sequence_hash"] == sequence_hashes(list(leaf))[-1]
    assert diff.details("b") == []


def test_tiers_are_part_of_a_block() -> None:
    device = RouterEvent(1, Stored(None, [10], [3]))
    host = RouterEvent(1, Stored(None, [10], [3], Tier.host_pinned))
    diff = diff_events([device], [device, host])
    assert [(b["side"], b["tier"]) for b in diff.to_dict()["only_b"]] == [("b", "host_pinned")]


def test_details_limit_counts_stay_complete() -> None:
    a = [RouterEvent(1, Stored(None, [10, 11, 12], [3, 4, 5]))]
    diff = diff_events(a, [])
    result = diff.to_dict(limit=2)
    assert result["workers"][0]["only_a"] == 3
    assert [b["depth"] for b in result["only_a"]] == [1, 2]


def test_stats_of_the_dynamo_fixture() -> None:
    stats = tree_stats(FIXTURE, top=2)
    assert stats["blocks"] == sum(stats["workers"].values()) == 18
    assert stats["workers"] == {"1:0": 5, "2:0": 1, "2:1": 7, "9223372036854775815:0": 5}
    assert sum(d["held"] for d in stats["depths"]) == 18
    assert [(d["min"], d["max"]) for d in stats["depths"]] == [(1, 1), (2, 3), (4, 7)]
    top = stats["shared_prefixes"]
    assert [(p["holders"], p["depth"]) for p in top] == [(3, 2), (2, 4)]
    assert top[0]["workers"] == ["1:0", "2:1", "9223372036854775815:0"]


def test_outline_collapses_chains_and_stops_at_depth() -> None:
    events = [RouterEvent(1, Stored(None, [1, 2, 3], [7, 8, 9])), RouterEvent(2, Stored(None, [1, 2], [7, 8])),
              RouterEvent(1, Stored(3, [4], [5])), RouterEvent(1, Stored(3, [6], [6]))]
    content = index_content(events)
    (root,) = outline(content)
    assert root.blocks(content.trie) == 2 and set(root.holders) == {(1, 0), (2, 0)}
    (mid,) = root.children
    assert mid.blocks(content.trie) == 1 and len(mid.children) == 2
    (cut,) = outline(content, max_levels=1)
    assert cut.children == [] and cut.hidden == 1
