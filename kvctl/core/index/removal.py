"""Removal: a worker letting go of blocks, Dynamo's way, and the deferred freeing that keeps it fast.

The tree's own methods (`Removal`, a base of `RadixTree`), in a module of their own because they are the index's
largest piece of logic: which edge a removed hash cuts, which runs of an edge go at once, and which lookup entries
of freed nodes are left for `reclaim` to pop while the server is idle. The fields they work on are the tree's,
declared here with their types; this module does not import the tree.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import repeat
from operator import is_
from typing import TYPE_CHECKING

from kvctl.core.index.block_map import BlockMap, unbind
from kvctl.core.index.node import ApplyResult, Deferred, Node, Status
from kvctl.core.names import WorkerKey

if TYPE_CHECKING:
    from kvctl.core._native_py import U64Map

_DEAD_SLACK = 1024
"""Entries a worker's lookup may grow by, beyond a quarter more than its size when it started keeping
dead ones, before `remove` pops dead ones itself instead of leaving them to `reclaim`."""

_DROP_AT_ONCE = 16_384
"""Entries of a dead map let go at once (about a millisecond); a larger one is left to `reclaim`."""

# What a freed node keeps of its local hashes once they are let go (never written to). Its engine hashes stay
# until the node goes: the map's and lookups' entries for it are popped by them.
_RELEASED = array("Q")


class Removal:
    """A worker's blocks let go, and the memory of freed nodes given back: `RadixTree`'s (this is its base)."""

    _slots: dict[WorkerKey, int]
    _shadows: set[int]
    _map: BlockMap
    _held_nodes: list[set[Node] | None]
    _count: list[int]
    _lookup: list[dict[int, Node] | None]
    _deferred: list[Deferred]
    _garbage: list[dict[int, Node] | U64Map]
    hash_mismatches: dict[WorkerKey, int]

    if TYPE_CHECKING:  # the tree's, which its removals call
        def _slot(self, worker: WorkerKey) -> int: ...

        def _shadow(self, slot: int) -> None: ...

        def _after_loss(self, node: Node) -> None: ...

    def remove(self, worker: WorkerKey, block_hashes: Sequence[int]) -> ApplyResult:
        """Let the worker go of blocks, Dynamo's way; a node nobody holds any more is freed.

        Most removals free the node they empty (engines evict whole requests, leaf first). Popping each
        of its hashes from the worker's lookup, and freeing them, would cost cache misses per block, so
        those entries are left in place, pointing at the freed node: every reader takes such an entry
        for no entry, and `_deferred` counts them. `reclaim` pops them later, when the server is idle; a
        worker that lets go of everything hands its whole lookup over at once; and a lookup that keeps
        growing meanwhile pops them here once it is a quarter larger. The count is exact only where the
        lookup names each block of the edge exactly once (no shadow, no hash mismatch, no hash twice in
        the edge), so elsewhere entries are popped one by one as before.

        `block_hashes` may be a list or an `array('Q')` (as the decode process sends them); a freed node's edge
        index goes with its lookup entries, when they are popped.
        """
        slot = self._slots.get(worker)
        if slot is None:
            self._slot(worker)
            return ApplyResult(Status.block_not_found, 0, len(block_hashes))
        bit = 1 << slot
        lookup = self._lookup[slot]
        if lookup is None:
            return self._remove_mapped(slot, block_hashes)
        shadows = self._shadows
        removed = missing = 0
        # (edge hashes, start, end) of what went stale: only searched when a hash is missing, which is rare
        made_stale: list[tuple[array[int], int, int]] = []
        hashes = block_hashes
        n = len(hashes)
        i = 0
        while i < n:
            h = hashes[i]
            i += 1
            node = lookup.pop(h, None)
            if node is None or (node.freed and slot not in shadows):
                if node is not None:
                    self._deferred[slot].dead -= 1
                if not any(h in run[lo:hi] for run, lo, hi in made_stale):
                    missing += 1
                continue
            pos = node.position(h)
            if pos is None:
                lookup[h] = node
                missing += 1
                continue
            removed += 1
            cut = node.cutoff(slot)
            if pos >= cut:
                if cut:  # a duplicate hash resolved to a later position: the worker still holds this edge
                    self._shadow(slot)
                made_stale.append((array("Q", (h,)), 0, 1))
                continue
            # The following hashes of this edge the worker still holds, in one step; a slot whose lookup ever lost
            # track of a node (`_shadows`) has the run checked against it
            unique = node.indexed_once()
            i, pos, taken = _take_run(lookup, node, hashes, h, i, pos, cut, unique, slot not in shadows)
            removed += taken
            # The worker keeps only edge[:pos]: the rest of what it held of this edge goes stale (not
            # its blocks in child edges). A later hash of the same event made stale here is no error.
            made_stale.append((node.packed, pos, cut))
            _cut(node, bit, slot, pos)
            if (pos == 0 and unique and not node.has_workers() and slot not in shadows
                    and worker not in self.hash_mismatches):
                deferred = self._deferred[slot]
                if not deferred.nodes:
                    deferred.base = len(lookup) + 1
                deferred.nodes.append(node)
                deferred.dead += cut - 1  # edge[:cut] but h, which is popped
                self._after_loss(node)
                if not shadows:  # nothing reads them again (a shadow slot's stale entry might)
                    node.locals = _RELEASED
                continue
            popped = set(map(lookup.pop, node.packed[pos:cut], repeat(None)))
            popped.difference_update((None, node))
            # A stale hash that the worker also stored elsewhere (another node, or earlier in this
            # edge: the edge index then has fewer entries than the edge) loses that binding too.
            if popped or (pos and not unique):
                self._shadow(slot)
            self._after_loss(node)
        self._tidy(slot)
        if missing:
            return ApplyResult(Status.block_not_found, removed, missing)
        return ApplyResult(Status.ok, removed)

    def _remove_mapped(self, slot: int, hashes: Sequence[int]) -> ApplyResult:
        """`remove` for a worker in the map (`RadixTree._map`): it holds a hash where the map's node covers its place
        for the worker, so nothing is popped: a node freed here leaves its entries to `reclaim`.

        The same steps as for a lookup of its own, which the map holds only while they are simple: every edge it holds
        names each hash once and every hash it holds is bound there, so each step trusts the map."""
        bit = 1 << slot
        shared = self._map.nodes
        held = self._held_nodes[slot]
        assert held is not None
        removed = missing = lost = 0
        made_stale: list[tuple[array[int], int, int]] = []  # see `remove`
        n = len(hashes)
        i = 0
        while i < n:
            h = hashes[i]
            i += 1
            node = shared.get(h)
            pos = None if node is None or node.freed else node.position(h)
            cut = 0 if pos is None else node.cutoff(slot)  # type: ignore[union-attr]
            if pos is None or pos >= cut:
                if not any(h in run[lo:hi] for run, lo, hi in made_stale):
                    missing += 1
                continue
            assert node is not None
            i, pos, taken = _take_run(shared, node, hashes, h, i, pos, cut, True, True)
            removed += 1 + taken
            made_stale.append((node.packed, pos, cut))
            lost += cut - pos
            _cut(node, bit, slot, pos)
            if pos == 0:
                held.discard(node)
            self._after_loss(node)
            if node.freed and not self._shadows:
                node.locals = _RELEASED
        self._count[slot] -= lost
        self._tidy_map(slot)
        if missing:
            return ApplyResult(Status.block_not_found, removed, missing)
        return ApplyResult(Status.ok, removed)

    def _tidy(self, slot: int) -> None:
        """Hand an emptied lookup to `reclaim`; keep a churning one within 1.25x its size (amortised)."""
        lookup = self._lookup[slot]
        assert lookup is not None
        deferred = self._deferred[slot]
        if len(lookup) == deferred.dead:
            if lookup:
                self._garbage.append(lookup)
            self._lookup[slot] = {}  # a dict never shrinks its table; an emptied worker gives it back
            self._deferred[slot] = Deferred()
            return
        nodes = deferred.nodes
        while nodes and len(lookup) > deferred.base + (deferred.base >> 2) + _DEAD_SLACK:
            self._release(slot, nodes.pop())

    def _tidy_map(self, slot: int) -> None:
        """Hand the map to `reclaim` once no worker in it holds anything (every entry is dead); else keep it within a
        quarter more than its live entries (amortised). A worker that holds nothing gets a new set of held nodes."""
        if not self._count[slot]:  # a set never shrinks its table either: an emptied worker gives it back
            self._held_nodes[slot] = set()
        block_map = self._map
        if not self._count[slot] and not any(self._count):
            if len(block_map.nodes) > _DROP_AT_ONCE:
                self._garbage.append(block_map.nodes)
            self._map = BlockMap()
            return
        freed = block_map.freed
        while freed and block_map.freed_entries > (block_map.live() >> 2) + _DEAD_SLACK:
            block_map.release(freed.pop())

    def _release(self, slot: int, node: Node) -> int:
        """Pop what the slot's lookup still holds of a node it freed; returns the hashes looked up."""
        lookup = self._lookup[slot]
        assert lookup is not None
        self._deferred[slot].dead -= unbind(lookup, node)
        return len(node.packed)

    def reclaim(self, budget: int) -> bool:
        """Give back about `budget` entries of freed nodes' memory; True while there is more.

        `remove` leaves this work for later, so a burst of removals is applied at the speed of the index
        rather than of the allocator; a server calls this while idle, a slice at a time.
        """
        garbage = self._garbage
        while budget > 0 and garbage:
            lookup = garbage[-1]
            n = min(budget, len(lookup))
            for _ in repeat(None, n):
                lookup.popitem()
            budget -= n
            if not lookup:
                garbage.pop()
        block_map = self._map
        freed = block_map.freed
        while budget > 0 and freed:
            budget -= block_map.release(freed.pop())
        for slot, deferred in enumerate(self._deferred):
            nodes = deferred.nodes
            while budget > 0 and nodes:
                budget -= self._release(slot, nodes.pop())
        return bool(garbage) or bool(freed) or any(d.nodes for d in self._deferred)


def _take_run(index: dict[int, Node] | U64Map, node: Node, hashes: Sequence[int], h: int, i: int, pos: int, cut: int,
              unique: bool, trusted: bool) -> tuple[int, int, int]:
    """After `h`, at `pos` of `node`: the event's next hashes that are more of the edge the worker holds, taken at
    once (the same end state as one by one, as Dynamo does). Engines evict runs of one edge together: leaf-first
    eviction walks the edge backwards to its start, and a request evicted whole from its first block walks it
    forwards; when the rest of the event is exactly that, one compare of packed slices takes the run instead of two
    lookups per block (and the edge's index is never built). That needs each hash at one place (`unique`: no
    repeat in the edge) and, unless the worker's `index` is `trusted`, a check that the run is still bound there.
    Returns the event's next place, the lowest place taken, and the hashes taken."""
    n = len(hashes)
    taken = 0
    if unique:
        k = min(pos, n - i)
        if k and _bound_run(index, node, hashes, i, pos - k, pos, trusted, backwards=True):
            taken, i, pos = k, i + k, pos - k
        elif (k := min(cut - pos - 1, n - i)) > 0 and _bound_run(index, node, hashes, i, pos + 1, pos + 1 + k,
                                                                trusted, backwards=False):
            taken, i = k, i + k
    while i < n and hashes[i] != h and index.get(hashes[i]) is node:  # (h is popped from a lookup of its own)
        nxt = node.positions().get(hashes[i])
        if nxt is None or nxt >= cut:
            break
        pos = min(pos, nxt)
        taken += 1
        i += 1
    return i, pos, taken


def _cut(node: Node, bit: int, slot: int, pos: int) -> None:
    """The worker keeps only edge[:pos] of `node`."""
    if pos == 0:
        node.drop(bit, slot)
    else:
        node.full &= ~bit
        if node.cutoffs is None:
            node.cutoffs = {slot: pos}
        else:
            node.cutoffs[slot] = pos


def _bound_run(lookup: dict[int, Node] | U64Map, node: Node, hashes: Sequence[int], i: int, lo: int, hi: int,
               trusted: bool, *, backwards: bool) -> bool:
    """The event's hashes from `i` on are the edge's [lo, hi), backwards or forwards, and the worker's lookup binds
    them to `node` (known without looking for a `trusted` slot, one whose lookup never lost track of a node)."""
    run = node.packed[lo:hi]
    if backwards:
        run.reverse()
    ahead = hashes[i : i + hi - lo]
    if (ahead if type(ahead) is array else array("Q", ahead)) != run:
        return False
    return trusted or all(map(is_, map(lookup.get, node.packed[lo:hi]), repeat(node)))


