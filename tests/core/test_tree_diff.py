"""tree_diff compares content, not shape: re-chunked, re-numbered, re-hashed dumps of the same blocks are
equal, whatever order their slower tiers' blocks come in (Dynamo's `/dump` lists them in hash-map order), and
one block taken from one worker is named exactly. Also the stats and the drawn outline."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from xxhash import xxh3_64_intdigest

from kvctl.core.events import Removed, RouterEvent, Stored, Tier
from kvctl.core.events.dump_file import iter_indexer_dump, read_router_events, router_event_of
from kvctl.core.hashing import sequence_hashes
from kvctl.core.names import WorkerKey, format_worker
from kvctl.core.tree_diff import IndexContent, diff_events, index_content, outline, tree_stats
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


# ----- tiers: a dump's blocks in any order Dynamo's semantics allow ----------------------------------------

RANKS = {Tier.device: 0, Tier.host_pinned: 1, Tier.disk: 2, Tier.external: 3}
Held = set[tuple[Tier, Path]]

# What a worker stores on a tier: `sequence` from its block `start` on (moved back to where a faster tier or its
# own holds the prefix before it: a slower tier's store continues a faster tier's path, as an offload does).
tiered_contents = st.dictionaries(
    st.sampled_from(WORKERS),
    st.lists(st.tuples(st.sampled_from(list(Tier)), sequences, st.integers(0, 6)), min_size=1, max_size=6),
    min_size=1)


def stored(event: RouterEvent) -> Stored:
    assert type(event.data) is Stored
    return event.data


def tiered_stream(content: dict[WorkerKey, list[tuple[Tier, Path, int]]], salt: int,
                  rng: random.Random) -> tuple[list[RouterEvent], dict[WorkerKey, Held]]:
    """Raw events storing `content` (chained, chunked at random), and what each worker then holds."""
    events: list[RouterEvent] = []
    expected: dict[WorkerKey, Held] = {}
    for worker, stores_of in content.items():
        held = expected[worker] = set()
        for tier, sequence, start in sorted(stores_of, key=lambda s: RANKS[s[0]]):
            faster = {path for t, path in held if RANKS[t] <= RANKS[tier]}
            start = max(i for i in range(min(start, len(sequence) - 1) + 1) if i == 0 or sequence[:i] in faster)
            chain = stores(worker, sequence, [start, *rng.sample(range(start + 1, start + 8), rng.randint(0, 3))], salt)
            for event in chain[1 if start else 0:]:  # not the blocks before `start`: a faster tier holds them
                data = stored(event)
                events.append(RouterEvent(worker[0], Stored(data.parent_hash, data.block_hashes, data.tokens_hashes,
                                                            tier), worker[1]))
            held.update((tier, sequence[:i]) for i in range(start + 1, len(sequence) + 1))
    return events, expected


def dynamo_order(dump: list[RouterEvent], rng: random.Random) -> list[RouterEvent]:
    """A dump as Dynamo's `/dump` may list it, and more: the device edges in a random order that still puts
    parents first (the device tree rejects a child before its parent), every slower tier's blocks one an event
    in any order, slipped in anywhere (their stores need no parent), each tier's event ids from 0."""
    device = [e for e in dump if stored(e).tier is Tier.device]
    lower = [RouterEvent(e.worker_id, Stored(parent, [block], [local], stored(e).tier), e.dp_rank)
             for e in dump if stored(e).tier is not Tier.device
             for parent, block, local in zip([stored(e).parent_hash, *stored(e).block_hashes],
                                             stored(e).block_hashes, stored(e).tokens_hashes, strict=False)]
    rng.shuffle(lower)
    ordered: list[RouterEvent] = []
    known: set[tuple[WorkerKey, int]] = set()
    while device or lower:
        ready = [e for e in device if stored(e).parent_hash is None or (e.worker, stored(e).parent_hash) in known]
        if lower and (not ready or rng.random() < 0.5):
            ordered.append(lower.pop())
            continue
        event = rng.choice(ready)
        device.remove(event)
        ordered.append(event)
        known.update((event.worker, h) for h in stored(event).block_hashes)
    ids: dict[Tier, int] = {}
    renumbered = []
    for e in ordered:
        n = ids[stored(e).tier] = ids.get(stored(e).tier, -1) + 1
        renumbered.append(RouterEvent(e.worker_id, e.data, e.dp_rank, n))
    return renumbered


def held_paths(content: IndexContent) -> dict[WorkerKey, Held]:
    return {w: {(tier, tuple(content.trie.path(pid))) for tier, pid in blocks} for w, blocks in content.held.items()}


@settings(max_examples=200, deadline=None)
@given(tiered_contents, st.randoms(use_true_random=False))
def test_a_dump_in_any_order_dynamo_allows_holds_the_same_blocks(
        content: dict[WorkerKey, list[tuple[Tier, Path, int]]], rng: random.Random) -> None:
    stream, expected = tiered_stream(content, 1, rng)
    dump = index_content(stream).index.dump()
    shuffled = dynamo_order(dump, rng)
    assert held_paths(index_content(shuffled)) == expected  # nothing left out, on any tier
    for a, b in ((stream, shuffled), (dump, shuffled), (shuffled, dynamo_order(dump, rng)),
                 (shuffled, tiered_stream(content, 2, rng)[0])):  # the last: other engine hashes
        diff = diff_events(a, b)
        assert diff.equal, diff.to_dict()
        assert {(w["worker_id"], w["dp_rank"]): w["blocks_a"] for w in diff.summary()} == {
            w: len(held) for w, held in expected.items()}


@settings(max_examples=150, deadline=None)
@given(tiered_contents, st.randoms(use_true_random=False), st.data())
def test_a_block_missing_from_a_shuffled_dump_is_named_exactly(
        content: dict[WorkerKey, list[tuple[Tier, Path, int]]], rng: random.Random, data: st.DataObject) -> None:
    stream, expected = tiered_stream(content, 1, rng)
    worker = data.draw(st.sampled_from(sorted(expected)))
    # a block no other block of the worker continues, on any tier: taking it takes nothing else
    leaves = sorted((tier, path) for tier, path in expected[worker]
                    if not any(len(p) == len(path) + 1 and p[:-1] == path for _, p in expected[worker]))
    tier, leaf = data.draw(st.sampled_from(leaves))
    shuffled = dynamo_order(index_content(stream).index.dump(), rng)
    if tier is Tier.device:
        trimmed = [*stream, RouterEvent(worker[0], Removed([engine_hash(leaf, 1)]), worker[1])]
    else:  # a slower tier's block is one event of the dump: leave it out
        trimmed = [e for e in shuffled if not (e.worker == worker and stored(e).tier is tier
                                               and stored(e).block_hashes == [engine_hash(leaf, 1)])]
        assert len(trimmed) == len(shuffled) - 1
    diff = diff_events(shuffled, dynamo_order(index_content(trimmed).index.dump(), rng))
    assert [(w["worker_id"], w["dp_rank"], w["only_a"], w["only_b"]) for w in diff.summary()
            if w["only_a"] or w["only_b"]] == [(*worker, 1, 0)]
    (block,) = diff.details("a")
    assert (block["tier"], block["depth"], block["local_hash"]) == (tier.value, len(leaf), leaf[-1])


def test_a_slower_tier_continues_a_faster_tiers_path_never_a_slower_ones() -> None:
    """A host block under a device block is reached by a query (device match, then host); one under a disk
    block is not (the host tier is walked before the disk), nor one whose parent the worker holds nowhere.
    So Dynamo 1.6.1's indexer does: fed these stores (block size 4), it answers a `/query` of the whole path
    with gpu 8, cpu 12 and disk 16 tokens (2, 3 and 4 blocks)."""
    events = [RouterEvent(1, Stored(None, [10, 11], [1, 2])),
              RouterEvent(1, Stored(11, [12], [3], Tier.host_pinned)),  # device 1,2 then host 3
              RouterEvent(1, Stored(12, [13], [4], Tier.disk)),  # then disk 4
              RouterEvent(1, Stored(13, [14], [5], Tier.host_pinned)),  # host under disk: unreachable
              RouterEvent(1, Stored(99, [15], [6], Tier.external))]  # no parent anywhere
    for order in (events, events[::-1]):
        assert held_paths(index_content(order)) == {(1, 0): {
            (Tier.device, (1,)), (Tier.device, (1, 2)), (Tier.host_pinned, (1, 2, 3)), (Tier.disk, (1, 2, 3, 4))}}


# ----- a real Dynamo 1.6.1 dump: lower tiers in hash-map order ---------------------------------------------

TIERS_DUMP = (FIXTURES / "dynamo-1.6.1" / "dump_lower_tiers_unordered.json").read_text()
DEVICE_DEPTH = 16
"""Each worker of that dump holds prompt A's 20 pages on its slower tier, and the first 16 on the device."""


def dynamo_dump_events(text: str) -> list[RouterEvent]:
    ((_, items),) = [(model, list(items)) for model, items in iter_indexer_dump([text])]
    return [router_event_of(item) for item in items]


def parents_first(events: list[RouterEvent]) -> list[RouterEvent]:
    """The same blocks, each worker's and tier's parents before their children, a Stored each, other engine
    hashes (those of `engine_hash`)."""
    content = index_content(events)
    out = []
    for worker, blocks in sorted(content.held.items()):
        for tier, pid in sorted(blocks, key=lambda b: (RANKS[b[0]], content.trie.depths[b[1]])):
            path = tuple(content.trie.path(pid))
            parent = engine_hash(path[:-1], 0) if len(path) > 1 else None
            out.append(RouterEvent(worker[0], Stored(parent, [engine_hash(path, 0)], path[-1:], tier), worker[1]))
    return out


def depths(events: list[RouterEvent]) -> dict[tuple[WorkerKey, int], int]:
    """Each (worker, engine hash)'s depth, read up its parent hashes (one path per hash in the fixture)."""
    parent_of = {}
    for e in events:
        data = stored(e)
        for parent, block in zip([data.parent_hash, *data.block_hashes], data.block_hashes, strict=False):
            parent_of[(e.worker, block)] = parent

    def depth(key: tuple[WorkerKey, int]) -> int:
        parent = parent_of[key]
        return 1 if parent is None else 1 + depth((key[0], parent))

    return {key: depth(key) for key in parent_of}


def test_dynamos_dump_lists_lower_tiers_out_of_order() -> None:
    """What the fixture is for: slower tiers' blocks one an event, some before their parent, ids from 0 again."""
    events = dynamo_dump_events(TIERS_DUMP)
    seen: set[tuple[WorkerKey, Tier, int]] = set()
    early = 0
    for e in events:
        data = stored(e)
        if data.tier is not Tier.device:
            assert len(data.block_hashes) == 1
            early += data.parent_hash is not None and (e.worker, data.tier, data.parent_hash) not in seen
        seen.update((e.worker, data.tier, h) for h in data.block_hashes)
    assert early == 27  # 9 of each slower tier's 20
    assert [e.event_id for e in events].count(0) == 4  # the device, then each slower tier


def test_a_real_dynamo_dump_equals_its_blocks_in_any_order() -> None:
    events = dynamo_dump_events(TIERS_DUMP)
    held = Counter((format_worker(w), tier.value) for w, blocks in index_content(events).held.items()
                   for tier, _ in blocks)
    # the device: prompt A but its last 4 pages, a sentinel (worker 2: a LoRA prompt too); a slower tier: all of A
    assert held == {("0:0", "device"): 17, ("0:0", "host_pinned"): 20, ("1:1", "device"): 17, ("1:1", "disk"): 20,
                    ("2:0", "device"): 37, ("2:0", "external"): 20}
    reversed_tiers = [e for e in events if stored(e).tier is Tier.device] + [
        e for e in events[::-1] if stored(e).tier is not Tier.device]
    for other in (parents_first(events), reversed_tiers, dynamo_order(events, random.Random(7)),
                  dynamo_order(parents_first(events), random.Random(8))):
        diff = diff_events(events, other)
        assert diff.equal, diff.to_dict()
        assert {w["worker"]: (w["blocks_a"], w["blocks_b"]) for w in diff.summary()} == {
            "0:0": (37, 37), "1:1": (37, 37), "2:0": (57, 57)}


def test_a_real_dynamo_dump_without_one_block_differs_by_that_block_and_what_hangs_under_it() -> None:
    events = dynamo_dump_events(TIERS_DUMP)
    depth_of = depths(events)
    ordered = parents_first(events)
    for n, event in enumerate(events):
        data = stored(event)
        if data.tier is Tier.device:
            continue
        diff = diff_events(ordered, dynamo_order(events[:n] + events[n + 1:], random.Random(n)))
        assert not diff.equal
        rows = diff.details("a")
        # the block, and those of its tier below it that no query reaches any more: a block whose parent the
        # device also holds (prompt A's first 16 pages) still continues the device's path
        depth = depth_of[(event.worker, data.block_hashes[0])]
        assert sorted(r["depth"] for r in rows) == ([depth] if depth <= DEVICE_DEPTH else list(range(depth, 21)))
        assert {(r["worker"], r["tier"]) for r in rows} == {(format_worker(event.worker), data.tier.value)}
        assert diff.details("b") == []
