"""KvIndex against a reference model: each worker key holds a prefix-closed set of block paths.

A block is identified by its path from the root (a tuple of local hashes); its engine hash is a
deterministic function of that path, so hashes agree across workers as real engines' do. Stores go
under the root or under a block the worker holds; removals only take blocks the worker holds no
descendant of (engines evict tail-first). Under those rules Dynamo's edge compression is invisible,
so the matched depth of a query for a worker is simply its longest held prefix of the query.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from xxhash import xxh3_64_intdigest

from kvctl.core.events import Cleared, Removed, RouterEvent, Stored, Tier
from kvctl.core.hashing import sequence_hashes
from kvctl.core.index import KvIndex, Status, removal
from kvctl.core.index.branch_seqs import BranchSeqs
from kvctl.core.index.kv_index import DumpEdge, events_of
from kvctl.core.index.sequence_path import path_of_sequence
from kvctl.core.names import WorkerKey
from tests.core.index_checks import assert_lookups_consistent

Path = tuple[int, ...]

# Local hashes: a small alphabet so prefixes collide across workers, with values across the u64 range.
ALPHABET = (3, 2**63 + 11, 2**64 - 1)
WORKER_IDS = (1, 2, 2**63 + 7)
WORKERS = [(w, dp) for w in WORKER_IDS for dp in (0, 1)]


def engine_hash(path: Path) -> int:
    """The engine's block hash of a block: a function of its whole path (a real sequence hash is)."""
    return xxh3_64_intdigest(b"".join(h.to_bytes(8, "little") for h in path), seed=99)


def stored(worker: WorkerKey, parent: Path | None, paths: list[Path]) -> RouterEvent:
    data = Stored(
        None if parent is None else engine_hash(parent),
        [engine_hash(p) for p in paths],
        [p[-1] for p in paths],
    )
    return RouterEvent(worker[0], data, worker[1])


def removed(worker: WorkerKey, hashes: list[int], packed: bool = False) -> RouterEvent:
    """`packed`: the hashes as an `array('Q')`, as the router's decode process hands them over."""
    return RouterEvent(worker[0], Removed(array("Q", hashes) if packed else hashes), worker[1])


def chain(parent: Path, symbols: Iterable[int]) -> list[Path]:
    out: list[Path] = []
    path = parent
    for s in symbols:
        path = path + (s,)
        out.append(path)
    return out


def longest_held_prefix(held: set[Path], query: list[int]) -> int:
    depth = 0
    while depth < len(query) and tuple(query[: depth + 1]) in held:
        depth += 1
    return depth


def leaves(held: set[Path]) -> list[Path]:
    """Held blocks with no held descendant (held sets are prefix-closed: no held child suffices)."""
    parents = {p[:-1] for p in held}
    return sorted(p for p in held if p not in parents)


symbols = st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=5)


@pytest.fixture(autouse=True)
def rebuild_lookups_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lookups are rebuilt as soon as half their entries are dead, so these small trees exercise it
    (the oracle tests keep the default, where dead entries live long)."""
    monkeypatch.setattr(removal, "_DEAD_SLACK", 0)


class IndexModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = KvIndex()
        # Every branch point's map kept, so that the tree's every change to one is checked against the model
        self.index.device.branches.wide = 1
        self.model: dict[WorkerKey, set[Path]] = {w: set() for w in WORKERS}
        self.extra_queries: list[list[int]] = []
        self.captures: list[tuple[list[DumpEdge], list[RouterEvent]]] = []

    # ----- helpers -------------------------------------------------------------------------------------

    def holders(self) -> list[WorkerKey]:
        return [w for w in WORKERS if self.model[w]]

    def snapshot(self) -> dict[WorkerKey, frozenset[Path]]:
        return {w: frozenset(p) for w, p in self.model.items()}

    def queries(self) -> list[list[int]]:
        every = set().union(*self.model.values())
        qs: list[list[int]] = [[]]
        for path in sorted(every):
            qs.append(list(path))
            qs.append(list(path) + [ALPHABET[0]])
            qs.append(list(path) + [ALPHABET[2], ALPHABET[1]])
        qs.extend(self.extra_queries)
        return qs

    def expected(self, query: list[int]) -> dict[WorkerKey, int]:
        out = {}
        for w, held in self.model.items():
            depth = longest_held_prefix(held, query)
            if depth:
                out[w] = depth
        return out

    # ----- rules ---------------------------------------------------------------------------------------

    @rule(worker=st.sampled_from(WORKERS), syms=symbols)
    def store_at_root(self, worker: WorkerKey, syms: list[int]) -> None:
        paths = chain((), syms)
        result = self.index.apply(stored(worker, None, paths))
        assert result.status is Status.ok
        assert result.blocks == len(paths)
        self.model[worker].update(paths)

    @precondition(lambda self: self.holders())
    @rule(data=st.data(), syms=symbols)
    def store_under_held_block(self, data: st.DataObject, syms: list[int]) -> None:
        worker = data.draw(st.sampled_from(self.holders()), label="worker")
        parent = data.draw(st.sampled_from(sorted(self.model[worker])), label="parent")
        paths = chain(parent, syms)
        result = self.index.apply(stored(worker, parent, paths))
        assert result.status is Status.ok
        assert result.blocks == len(paths)
        self.model[worker].update(paths)

    @precondition(lambda self: self.holders())
    @rule(data=st.data())
    def restore_held_blocks(self, data: st.DataObject) -> None:
        """Re-storing blocks the worker already holds (vLLM re-emits hits; replays overlap) changes nothing.

        Node counts may change: a store under a block in the middle of an edge splits it, as in Dynamo.
        """
        worker = data.draw(st.sampled_from(self.holders()), label="worker")
        path = data.draw(st.sampled_from(sorted(self.model[worker])), label="path")
        cut = data.draw(st.integers(0, len(path) - 1), label="cut")
        parent = path[:cut] or None
        paths = [path[: i + 1] for i in range(cut, len(path))]
        before = self.index.stats()[Tier.device]
        result = self.index.apply(stored(worker, parent, paths))
        assert result.status is Status.ok
        after = self.index.stats()[Tier.device]
        assert (after.blocks, after.workers) == (before.blocks, before.workers)

    @rule(data=st.data(), syms=symbols)
    def store_under_unknown_parent(self, data: st.DataObject, syms: list[int]) -> None:
        worker = data.draw(st.sampled_from(WORKERS), label="worker")
        others = sorted(set().union(*self.model.values()) - self.model[worker])
        # A parent another worker holds (known to the tree, not to this worker), or one nobody holds.
        parent = data.draw(st.sampled_from(others) if others else st.just((7, 7)), label="parent")
        before = self.index.stats()[Tier.device]
        result = self.index.apply(stored(worker, parent, chain(parent, syms)))
        assert result.status is Status.parent_block_not_found
        assert result.blocks == 0
        after = self.index.stats()[Tier.device]
        assert (after.blocks, after.nodes) == (before.blocks, before.nodes)
        assert {w: n for w, n in after.workers.items() if n} == {w: n for w, n in before.workers.items() if n}

    @precondition(lambda self: self.holders())
    @rule(data=st.data(), count=st.integers(1, 4), unknown=st.booleans(), packed=st.booleans())
    def remove_leaves(self, data: st.DataObject, count: int, unknown: bool, packed: bool) -> None:
        """Evict `count` blocks tail-first in one event (each a leaf once the previous ones are gone)."""
        worker = data.draw(st.sampled_from(self.holders()), label="worker")
        held = set(self.model[worker])
        gone: list[Path] = []
        for _ in range(count):
            if not held:
                break
            leaf = data.draw(st.sampled_from(leaves(held)), label="leaf")
            held.discard(leaf)
            gone.append(leaf)
        hashes = [engine_hash(p) for p in gone]
        if unknown:  # an unknown hash in the middle is counted, the rest still applied
            hashes.insert(len(hashes) // 2, engine_hash((5, 5, 5)))
        result = self.index.apply(removed(worker, hashes, packed))
        assert result.status is (Status.block_not_found if unknown else Status.ok)
        assert (result.blocks, result.missing) == (len(gone), int(unknown))
        self.model[worker] = held

    @precondition(lambda self: self.holders())
    @rule(data=st.data(), depth=st.integers(1, 12), packed=st.booleans())
    def evict_branch_leaf_first(self, data: st.DataObject, depth: int, packed: bool) -> None:
        """One event taking a leaf and its ancestors, deepest first, as an engine frees a request's blocks:
        runs that walk whole edges backwards, across edges, and stop at a block still needed elsewhere."""
        worker = data.draw(st.sampled_from(self.holders()), label="worker")
        held = set(self.model[worker])
        leaf = data.draw(st.sampled_from(leaves(held)), label="leaf")
        gone: list[Path] = []
        for cut in range(len(leaf), max(0, len(leaf) - depth), -1):
            path = leaf[:cut]
            if any(p != path and p[:cut] == path for p in held):  # still a prefix of another held block
                break
            held.discard(path)
            gone.append(path)
        result = self.index.apply(removed(worker, [engine_hash(p) for p in gone], packed))
        assert result.status is Status.ok
        assert (result.blocks, result.missing) == (len(gone), 0)
        self.model[worker] = held

    @rule(worker=st.sampled_from(WORKERS), syms=st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=3))
    def remove_unknown(self, worker: WorkerKey, syms: list[int]) -> None:
        """A hash the worker does not hold (maybe another worker does): counted, nothing changes."""
        path = tuple(syms)
        if path in self.model[worker]:
            path = (5, *path)
        before = self.snapshot()
        result = self.index.apply(removed(worker, [engine_hash(path)]))
        assert result.status is Status.block_not_found
        assert (result.blocks, result.missing) == (0, 1)
        assert self.snapshot() == before

    @rule(worker=st.sampled_from(WORKERS))
    def clear(self, worker: WorkerKey) -> None:
        result = self.index.apply(RouterEvent(worker[0], Cleared(), worker[1]))
        assert result.status is Status.ok
        self.model[worker] = set()

    @rule(worker_id=st.sampled_from(WORKER_IDS))
    def remove_worker(self, worker_id: int) -> None:
        expected = sum(len(p) for w, p in self.model.items() if w[0] == worker_id)
        assert self.index.remove_worker(worker_id) == expected
        for dp in (0, 1):
            self.model[(worker_id, dp)] = set()
        known = self.index.stats()[Tier.device].workers
        assert not [w for w in known if w[0] == worker_id]

    @rule(query=st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=7))
    def remember_query(self, query: list[int]) -> None:
        self.extra_queries = [*self.extra_queries[-4:], query]

    @rule(budget=st.integers(1, 64))
    def reclaim_some(self, budget: int) -> None:
        """A server gives freed nodes' memory back when idle, a slice at a time: nothing held changes."""
        self.index.reclaim(budget)

    @rule()
    def reclaim_everything(self) -> None:
        while self.index.reclaim(16):
            pass
        assert self.index.debt == 0

    @rule()
    def capture_now(self) -> None:
        """A server captures the dump between two events and encodes it while later events apply."""
        self.captures = [*self.captures[-2:], (self.index.capture(), self.index.dump())]

    # ----- invariants ----------------------------------------------------------------------------------

    @invariant()
    def captures_do_not_change_under_later_events(self) -> None:
        for edges, at_capture in self.captures:
            assert list(events_of(edges)) == at_capture

    @invariant()
    def matches_equal_longest_held_prefix(self) -> None:
        sizes = {w: len(p) for w, p in self.model.items()}
        for q in self.queries():
            got = self.index.find_matches(q)
            want = self.expected(q)
            assert got.scores == want, q
            assert got.tree_sizes == {w: sizes[w] for w in want}, q

    @invariant()
    def a_query_is_found_by_its_sequence_hashes(self) -> None:
        """A Dynamo frontend publishes a request's blocks by sequence hash: the tree finds every worker's overlap
        from them alone (`path_of_sequence`), the path being a prefix of the query at least as deep as any."""
        for q in self.queries():
            want = self.expected(q)
            path = self.index.path_of_sequence(sequence_hashes(q))
            found = path.local_hashes
            assert not path.exhausted and found == q[:len(found)] and len(found) >= max(want.values(), default=0), q
            assert path == path_of_sequence(self.index.device, sequence_hashes(q), branches=BranchSeqs()), q
            assert self.index.find_matches(found).scores == want, q

    @invariant()
    def sizes_and_nodes(self) -> None:
        stats = self.index.stats()
        assert list(stats) == [Tier.device]
        device = stats[Tier.device]
        assert device.blocks == sum(len(p) for p in self.model.values())
        assert {w: n for w, n in device.workers.items() if n} == {w: len(p) for w, p in self.model.items() if p}
        distinct = set().union(*self.model.values())
        # Every live node holds at least one distinct block position: no dead subtree survives.
        assert device.nodes <= len(distinct)
        if not distinct:
            assert device.nodes == 0

    @invariant()
    def lookups_count_what_they_let_go(self) -> None:
        assert_lookups_consistent(self.index.device)

    @invariant()
    def engines_that_agree_on_hashes_show_no_mismatch(self) -> None:
        assert self.index.hash_mismatches() == {}

    @invariant()
    def dump_then_load_is_identical(self) -> None:
        events = self.index.dump()
        fresh = KvIndex()
        assert all(r.status is Status.ok for r in fresh.load(events))
        for q in self.queries():
            assert fresh.find_matches(q).scores == self.index.find_matches(q).scores, q
        stats = fresh.stats()[Tier.device]
        assert {w: n for w, n in stats.workers.items() if n} == {w: len(p) for w, p in self.model.items() if p}
        assert stats.blocks == sum(len(p) for p in self.model.values())


IndexModel.TestCase.settings = settings(
    max_examples=250,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestIndexModel = IndexModel.TestCase


def test_leaves_and_prefix_helpers() -> None:
    """The model's own helpers, on a hand-built held set."""
    held = {(1,), (1, 2), (1, 2, 3), (1, 4)}
    assert leaves(held) == [(1, 2, 3), (1, 4)]
    assert longest_held_prefix(held, [1, 2, 3, 9]) == 3
    assert longest_held_prefix(held, [1, 4, 3]) == 2
    assert longest_held_prefix(held, [2, 1]) == 0
    assert longest_held_prefix(held, []) == 0
    assert engine_hash((1, 2)) != engine_hash((2, 1))


def test_all_blocks_removed_frees_every_node() -> None:
    """Two workers share a split edge; evicting everything tail-first leaves no node (Dynamo leaks here)."""
    index = KvIndex()
    a, b = (1, 0), (2, 1)
    index.apply(stored(a, None, chain((), [3, 3, 3, 3])))
    index.apply(stored(b, None, chain((), [3, 3, 4])))
    index.apply(stored(b, (3, 3, 4), chain((3, 3, 4), [4])))
    assert index.stats()[Tier.device].nodes == 3  # edges [3,3] -> {[3,3], [4,4]}
    assert index.find_matches([3, 3, 4, 4]).scores == {a: 2, b: 4}
    assert index.apply(removed(a, [engine_hash((3, 3, 3, 3)), engine_hash((3, 3, 3))])).status is Status.ok
    assert index.apply(removed(b, [engine_hash((3, 3, 4, 4)), engine_hash((3, 3, 4))])).status is Status.ok
    assert index.find_matches([3, 3, 3]).scores == {a: 2, b: 2}
    assert index.apply(removed(a, [engine_hash((3, 3)), engine_hash((3,))])).status is Status.ok
    assert index.apply(removed(b, [engine_hash((3, 3)), engine_hash((3,))])).status is Status.ok
    stats = index.stats()[Tier.device]
    assert (stats.blocks, stats.nodes) == (0, 0)
    assert index.find_matches([3]).scores == {}


def test_a_worker_hashing_known_tokens_differently_is_counted_until_cleared() -> None:
    index = KvIndex()
    paths = chain((), (3, 2**63 + 11, 2**64 - 1))
    index.apply(stored((1, 0), None, paths))
    other_seed = Stored(None, [h ^ 1 for h in (engine_hash(p) for p in paths[:2])], [p[-1] for p in paths[:2]])
    assert index.apply(RouterEvent(2, other_seed, 0)).status is Status.ok
    assert index.hash_mismatches() == {(2, 0): 2}  # the first writer is not blamed
    assert index.find_matches([3, 2**63 + 11]).scores == {(1, 0): 2, (2, 0): 2}  # it still routes by tokens
    assert index.apply(stored((3, 0), None, paths)).status is Status.ok
    assert index.hash_agreements() == {(3, 0): 3}  # worker 3 hashes as worker 1 did, who stored first
    index.apply(RouterEvent(2, Cleared(), 0))
    index.apply(RouterEvent(3, Cleared(), 0))
    assert index.hash_mismatches() == index.hash_agreements() == {}

