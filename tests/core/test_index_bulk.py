"""An index built in bulk from its runs (`core.index.bulk`, a restart's v3 image) is the index it was read from.

Events are drawn freely (stores under the root or under any block stored before, by any worker, removals, clears,
workers removed, a worker that hashes some blocks its own way or repeats a hash), applied to an index; its
capture is turned into runs and built back. The built index must answer every query as the original does, hold
what the original's dump holds, and hold as much per worker as replaying that dump builds (what a v2 image
restores: the original may also count blocks no query can reach, which a dump leaves out).
"""

from __future__ import annotations

import re
from array import array

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvctl.core.events import Cleared, Removed, RouterEvent, Stored, Tier
from kvctl.core.index import KvIndex, bulk
from kvctl.core.names import WorkerKey
from tests.core.index_checks import assert_lookups_consistent
from tests.core.test_index_model import ALPHABET, WORKERS, chain, engine_hash

Path = tuple[int, ...]


def canonical(index: KvIndex) -> list[str]:
    """The index's dump without its synthetic event ids, in a fixed order."""
    return sorted(re.sub(r"event_id=\d+", "", repr(e)) for e in index.dump())


def lower(by_tier: dict[Tier, dict[WorkerKey, int]]) -> dict[Tier, dict[WorkerKey, int]]:
    """What the slower tiers add to a match (an index with an empty slower tier also reports the device's)."""
    return {t: s for t, s in by_tier.items() if s and t is not Tier.device}


def queries(paths: list[Path]) -> list[list[int]]:
    return [list(p) for p in paths] + [[*p, ALPHABET[0]] for p in paths] + [[ALPHABET[1], ALPHABET[2]]]


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[RouterEvent | int], list[Path], bool]:
    """Events (an int: that worker removed), the paths stored, and whether any worker hashed a block as no
    other does."""
    events: list[RouterEvent | int] = []
    paths: list[Path] = []
    odd = False
    may_be_odd = draw(st.integers(0, 4)) == 0  # most histories hash as engines do, so the bulk path is taken
    for _ in range(draw(st.integers(1, 20))):
        worker: WorkerKey = draw(st.sampled_from(WORKERS))
        kind = draw(st.sampled_from(["root", "copy", "copy", "under", "under", "lower", "remove", "clear", "drop"]))
        if kind in ("root", "copy", "under", "lower"):
            parent: Path = draw(st.sampled_from(paths)) if kind in ("under", "lower") and paths else ()
            if kind == "copy" and paths:  # a path another worker stored, from the root: often part of an edge
                new = chain((), draw(st.sampled_from(paths)))
            else:
                new = chain(parent, draw(st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=5)))
            hashes = [engine_hash(p) for p in new]
            if may_be_odd and draw(st.booleans()):  # an odd hasher, or one hash twice
                hashes[-1] = draw(st.sampled_from([hashes[0], engine_hash((7, *new[-1]))]))
                odd = True
            tier = Tier.host_pinned if kind == "lower" else Tier.device
            data = Stored(engine_hash(parent) if parent else None, hashes, [p[-1] for p in new], tier)
            paths.extend(new)
        elif kind == "remove" and paths:
            data = Removed([engine_hash(p) for p in draw(st.lists(st.sampled_from(paths), min_size=1, max_size=3))])
        elif kind == "drop":
            events.append(worker[0])
            continue
        else:
            data = Cleared()
        events.append(RouterEvent(worker[0], data, worker[1]))
    return events, paths, odd


def apply(index: KvIndex, events: list[RouterEvent | int]) -> None:
    for event in events:
        if isinstance(event, int):
            index.remove_worker(event)
        else:
            index.apply(event)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=histories())
def test_an_index_built_from_its_runs_is_the_index_it_was_read_from(
        history: tuple[list[RouterEvent | int], list[Path], bool]) -> None:
    events, paths, odd = history
    original = KvIndex()
    apply(original, events)
    built = KvIndex()
    fast = bulk.build(built, bulk.runs_of(original.capture(), max_pairs=4))  # several runs, even when small
    replayed = KvIndex()
    replayed.load(original.dump())
    assert fast or odd, "built by replaying events with every hash where a replay puts it"
    if not odd:  # the same edges as the original (a replay of its dump may merge a leaf with its only child)
        assert canonical(built) == canonical(original)
    # the same answers as the original, unless an odd hasher's dump holds events a replay refuses (a parent hash
    # among its blocks): then those of replaying the dump, what restoring a v2 image builds
    for reference in (replayed,) if odd else (replayed, original):
        for query in queries(paths):
            got, expected = built.find_matches(query), reference.find_matches(query)
            assert got.scores == expected.scores, query
            assert lower(got.by_tier) == lower(expected.by_tier), query
    assert {t: (s.blocks, s.workers) for t, s in built.stats().items() if s.blocks} == {
        t: (s.blocks, s.workers) for t, s in replayed.stats().items() if s.blocks}
    assert_lookups_consistent(built.device)


def test_a_store_after_the_build_extends_and_splits_as_in_the_original() -> None:
    """The built tree is not only equal at rest: the next events find the same edges."""
    original = KvIndex()
    prompt = chain((), ALPHABET)
    for w, tail in ((WORKERS[0], (3,)), (WORKERS[1], (2**63 + 11, 3))):
        original.apply(RouterEvent(w[0], Stored(None, [engine_hash(p) for p in prompt], [p[-1] for p in prompt]),
                                   w[1]))
        new = chain(prompt[-1], tail)
        original.apply(RouterEvent(w[0], Stored(engine_hash(prompt[-1]), [engine_hash(p) for p in new],
                                                [p[-1] for p in new]), w[1]))
    built = KvIndex()
    assert bulk.build(built, bulk.runs_of(original.capture()))
    assert built.device.nodes == original.device.nodes == 3
    later = RouterEvent(WORKERS[2][0], Removed(array("Q", [engine_hash(prompt[1])])), WORKERS[2][1])
    for index in (original, built):
        index.apply(RouterEvent(WORKERS[0][0], Stored(engine_hash(prompt[0]), [engine_hash((3, 9))], [9]),
                                WORKERS[0][1]))
        index.apply(later)
    assert canonical(built) == canonical(original)
    assert built.device.nodes == original.device.nodes
