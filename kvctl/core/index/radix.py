"""One radix tree of KV blocks per (model, tier): Dynamo 1.6.1's single-threaded index, leak fixed.

Semantics are Dynamo's `RadixTree` (lib/kv-router, the version in ai-dynamo-runtime 1.6.1), which is
the arbiter of scores (docs/contract.md). That tree compresses runs of blocks into edges and records, per
edge, which workers hold all of it (`full`) and which hold only a prefix (`cutoffs`). The edge
boundaries are part of its observable behaviour: removing a block cuts the worker off at that point
of the edge (the rest of the edge becomes stale for it) but not in child nodes. So kvctl keeps the
same edges, splits and leaf extensions rather than one node per block.

Where kvctl differs on purpose: a node no worker holds any more is detached from its parent and
freed (Dynamo keeps it in its parent's children forever: the leak fixed upstream by PR #11678). And Dynamo's
per-worker lookups (engine hash -> node) are one map for all workers (`block_map.py`, issue 40): a worker holds
a hash where the map's node covers its place for the worker. A worker the map cannot describe (a hash it holds
at two places, one another worker holds elsewhere, its own hashes for another's blocks) keeps a lookup of its
own, Dynamo's, with the same answers (`tests/core/test_index_map_twin.py` runs both).

Python-specific choices, all for speed and memory (see benchmarks/index_bench.py):
- worker keys `(worker_id, dp_rank)` map to small slot numbers; a node's full holders are one int
  bitmask, so find_matches intersects holders with one `&` per edge;
- an edge keeps its local hashes in an `array('Q')`: matching a query against an edge is one
  C-level slice comparison, and storing N blocks touches each block only inside C loops;
- an edge keeps its engine hashes packed only (`array('Q')`, 8 B a block), and the map keys them by the u64
  itself (`native.U64Map`): no int object per block, which was 48 B of a unique block's ~115 (issue 40). A store
  compares a run of an edge with one C comparison, and a removal, which may come packed from the router's
  decode process, too; ints are made only for the rare worker with a lookup of its own.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from itertools import repeat
from typing import TYPE_CHECKING

from kvctl.core import native
from kvctl.core.index import matching
from kvctl.core.index.block_map import BlockMap
from kvctl.core.index.branch_seqs import BranchSeqs
from kvctl.core.index.matching import Matches, common_prefix
from kvctl.core.index.node import OK_EMPTY, ApplyResult, Deferred, Node, Status, iter_bits
from kvctl.core.index.removal import Removal
from kvctl.core.names import WorkerKey, selects

if TYPE_CHECKING:
    from kvctl.core._native_py import U64Map

__all__ = ["OK_EMPTY", "ApplyResult", "Matches", "Node", "RadixTree", "Status", "iter_bits"]


class RadixTree(Removal):
    """The index of one tier of one model. Single writer; `find_matches` is read-only. Its removals
    (`remove`, `reclaim`) are in `removal.py`."""

    def __init__(self) -> None:
        self.root = Node(array("Q"), array("Q"), None, 0)
        self.root.internal = True
        self._slots: dict[WorkerKey, int] = {}
        self._workers: list[WorkerKey | None] = []  # slot -> worker key; None once removed
        self._retired = 0
        # Slots whose lookup once lost track of a node that still carries their bit (a worker that
        # stored one block hash at two places). Dynamo keeps crediting such a node to the
        # worker, even after remove_worker and back, so those slots keep their worker's identity.
        self._shadows: set[int] = set()
        self._ghosts: dict[WorkerKey, int] = {}  # removed workers whose bits may linger -> their slot
        # One engine hash -> node map for every worker (issue 40): a worker in it holds a hash where the node
        # covers its place for the worker. A worker the map cannot describe (see `_privatize`) keeps its own lookup.
        self._map = BlockMap()
        self._held_nodes: list[set[Node] | None] = []  # slot -> nodes it holds (in the map); None: private or gone
        self._count: list[int] = []  # slot -> blocks it holds (in the map)
        self._mapped = 0  # bits of the slots in the map
        self._lookup: list[dict[int, Node] | None] = []  # slot -> its own engine hash -> node; None: in the map
        self._deferred: list[Deferred] = []  # slot -> what its own lookup still holds of freed nodes: see `remove`
        # lookups of workers that let go of everything, and dead maps: see `reclaim`
        self._garbage: list[dict[int, Node] | U64Map] = []
        self.nodes = 0
        # Sequence hash -> child at branch points a frontend's request was looked up at: told of their every change
        self.branches = BranchSeqs()
        # Blocks a worker stored on a token path already indexed under other engine hashes: engines
        # that hash the same tokens differently (Dynamo's "block_hash mismatch"), whose removals then
        # miss and whose blocks other workers' lookups cannot find. Counted since the worker's last clear.
        self.hash_mismatches: dict[WorkerKey, int] = {}
        # Blocks a worker stored on a token path already indexed under the same engine hashes: it hashes as
        # some other worker does. A worker with mismatches and no agreements, among workers that agree, is the
        # odd hasher (`kvctl doctor` names it). Counted since the worker's last clear.
        self.hash_agreements: dict[WorkerKey, int] = {}

    # ----- workers -------------------------------------------------------------------------------------

    def _slot(self, worker: WorkerKey) -> int:
        slot = self._slots.get(worker)
        if slot is None:
            slot = self._ghosts.pop(worker, None)
            if slot is None:
                slot = len(self._workers)
                self._workers.append(worker)
                self._lookup.append(None)
                self._held_nodes.append(set())
                self._count.append(0)
                self._mapped |= 1 << slot
                self._deferred.append(Deferred())
            else:  # a shadow's: its own lookup again
                self._lookup[slot] = {}
                self._deferred[slot] = Deferred()
            self._slots[worker] = slot
        return slot

    def workers(self) -> list[WorkerKey]:
        return list(self._slots)

    def size(self, worker: WorkerKey) -> int:
        slot = self._slots.get(worker)
        return 0 if slot is None else self._held(slot)

    def _held(self, slot: int) -> int:
        """Blocks the slot holds: Dynamo's per-worker lookup size (of its own, less the entries let go lazily)."""
        lookup = self._lookup[slot]
        return self._count[slot] if lookup is None else len(lookup) - self._deferred[slot].dead

    def sizes(self) -> dict[WorkerKey, int]:
        return {w: self._held(s) for w, s in self._slots.items()}

    @property
    def blocks(self) -> int:
        """(worker, block) pairs held: Dynamo's `current_size`."""
        return sum(map(self._held, self._slots.values()))

    # ----- matching ------------------------------------------------------------------------------------

    def find_matches(self, local_hashes: Sequence[int], *, early_exit: bool = False) -> Matches:
        """Contiguous matched depth, in blocks, of every worker holding a prefix of `local_hashes`."""
        return matching.find_matches(self, local_hashes, early_exit)

    def path_hashes(self, local_hashes: Sequence[int], depths: set[int]) -> dict[int, int]:
        """For each depth d, the engine hash the tree keeps for block d-1 of the path `local_hashes` walks
        (`matching.path_hashes`)."""
        return matching.path_hashes(self, local_hashes, depths)

    # ----- mutation ------------------------------------------------------------------------------------

    def store(self, worker: WorkerKey, parent_hash: int | None, block_hashes: Sequence[int],
              tokens_hashes: Sequence[int]) -> ApplyResult:
        slot = self._slot(worker)
        bit = 1 << slot
        packed = (block_hashes if type(block_hashes) is array and block_hashes.typecode == "Q"
                  else array("Q", block_hashes))  # what the run's edges keep, sliced (copied) to their nodes
        locs = tokens_hashes if isinstance(tokens_hashes, array) else array("Q", tokens_hashes)
        nblocks = len(packed)
        distinct = native.u64s_distinct(packed)
        if not distinct:  # one hash at two places: a lookup key can name only one of them
            self._shadow(slot)
        if parent_hash is None:
            parent = self.root
        else:
            if parent_hash in packed:
                return ApplyResult(Status.invalid_block)
            lookup = self._lookup[slot]
            node = (self._map.nodes if lookup is None else lookup).get(parent_hash)
            pos = node.position(parent_hash) if node is not None else None
            if node is None or pos is None:
                return ApplyResult(Status.parent_block_not_found)
            if not node.covers(slot, pos):
                if lookup is None:  # in the map, a hash the worker does not hold: no entry of its own
                    return ApplyResult(Status.parent_block_not_found)
                del lookup[parent_hash]
                if node.freed and slot not in self._shadows:
                    self._deferred[slot].dead -= 1
                if node.cutoff(slot):  # a duplicate hash resolved past what the worker holds of the edge
                    self._shadow(slot)
                return ApplyResult(Status.parent_block_not_found)
            if self._reuse_parent_edge(node, pos, packed, locs, bit, slot):
                return ApplyResult(Status.ok, nblocks)
            if pos + 1 != len(node.packed):
                self._split(node, pos + 1)
            parent = node
        start = 0
        while start < nblocks:
            children = parent.children
            child = children.get(locs[start]) if children else None
            if child is None:
                if not parent.internal and parent.locals and parent.full & bit:
                    before = len(parent.locals)
                    added = packed[start:]
                    self._append_to_leaf(parent, added, locs[start:], bit, slot)
                    self._covered(slot, parent, before)
                    self._bind(slot, added, parent)
                    break
                child = Node(locs[start:], packed[start:], parent, bit, distinct=distinct)
                self.nodes += 1
                if children is None:
                    parent.children = {locs[start]: child}
                else:
                    children[locs[start]] = child
                if self.branches.kept:
                    self.branches.adopted(parent, locs[start], child)
                parent.internal = True
                self._covered(slot, child, 0)
                self._bind(slot, child.packed, child)
                break
            edge = child.locals
            elen = len(edge)
            rest = nblocks - start
            walk = elen if elen < rest else rest
            m = walk if edge[:walk] == locs[start : start + walk] else common_prefix(edge, locs, start, walk)
            before = child.cutoff(slot)
            if m < elen:
                if m == rest:
                    child.cover_prefix(bit, slot, m)
                    self._covered(slot, child, before)
                    self._bind_shared(slot, packed[start:], child, before)
                    break
                self._split(child, m)
                child.promote(bit, slot)
                self._covered(slot, child, min(before, m))
                self._bind_shared(slot, packed[start : start + m], child, before)
                start += m
                tail = Node(locs[start:], packed[start:], child, bit, distinct=distinct)
                self.nodes += 1
                if child.children is None:
                    child.children = {locs[start]: tail}
                else:
                    child.children[locs[start]] = tail
                if self.branches.kept:
                    self.branches.adopted(child, locs[start], tail)
                child.internal = True
                self._covered(slot, tail, 0)
                self._bind(slot, tail.packed, tail)
                break
            child.promote(bit, slot)
            self._covered(slot, child, before)
            self._bind_shared(slot, packed[start : start + elen], child, before)
            start += elen
            parent = child
        return ApplyResult(Status.ok, nblocks)

    def _covered(self, slot: int, node: Node, before: int) -> None:
        """Note, for a worker in the map, that a store made it hold `node`, of which it held `before` blocks."""
        held = self._held_nodes[slot]
        if held is not None:
            held.add(node)
            self._count[slot] += node.cutoff(slot) - before

    def _bind(self, slot: int, keys: array[int], node: Node, moving_from: Node | None = None) -> None:
        """Point `keys` of a worker's lookup at `node`, noting when that takes one away from another node.

        A worker in the map binds them there, unless a key is held elsewhere or the edge repeats a hash: it then
        gets a lookup of its own (`_privatize`), keyed by ints. In its own lookup, usually no key is bound
        elsewhere: `native.bind_run` binds the run while it checks that, one probe of the lookup a key, and leaves
        the keys from the first one bound elsewhere to the loop here."""
        lookup = self._lookup[slot]
        if lookup is None:
            if node.distinct and self._share(keys, node):
                return
            lookup = self._privatize(slot)
        done = native.bind_run(lookup, keys, node, moving_from)
        if done < len(keys):
            keys = keys[done:]
            bound = list(map(lookup.get, keys))
            previous = set(bound)
            previous.difference_update((None, node, moving_from))
            if previous and slot not in self._shadows:
                # entries let go lazily: taken back, no longer dead
                freed = [p for p in previous if p is not None and p.freed]
                if freed:
                    self._deferred[slot].dead -= sum(map(bound.count, freed))
                    previous.difference_update(freed)
            if previous:
                self._shadow(slot)
            lookup.update(zip(keys, repeat(node)))

    def _share(self, keys: array[int], node: Node) -> bool:
        """Bind a worker's `keys` to `node` in the map; False: the map cannot describe the worker."""
        return self._map.bind(keys, node)

    def _privatize(self, slot: int) -> dict[int, Node]:
        """Give a worker of the map a lookup of its own, with what the map says it holds, before the map stops
        describing it: a hash it holds at two places, a hash another worker holds elsewhere, an edge repeating
        a hash, its own hashes for another worker's blocks. Rare; from then on it is Dynamo's per-worker lookup."""
        held = self._held_nodes[slot]
        assert held is not None
        get = self._map.nodes.get
        lookup: dict[int, Node] = {}
        for node in held:
            lookup.update((h, node) for h in node.packed[: node.cutoff(slot)] if get(h) is node)
        self._lookup[slot] = lookup
        self._held_nodes[slot] = None
        self._count[slot] = 0
        self._mapped &= ~(1 << slot)
        return lookup

    def _shadow(self, slot: int) -> None:
        """Note a slot whose lookup lost track of a node; its entries are let go one by one from now on.

        Lazily let-go entries (see `remove`) rely on the lookup naming each held block exactly once, so
        a slot that turns shadow drops them first.
        """
        if slot in self._shadows:
            return
        lookup = self._lookup[slot]
        if lookup is None:
            lookup = self._privatize(slot)
        self._shadows.add(slot)
        deferred = self._deferred[slot]
        if deferred.nodes:
            for h in [h for h, node in lookup.items() if node.freed]:
                del lookup[h]
            self._deferred[slot] = Deferred()

    def _bind_shared(self, slot: int, keys: array[int], node: Node, before: int) -> None:
        """Bind keys to `node`'s first edge positions, of which the worker held `before`; count them as agreeing
        with the edge's own hashes, or not."""
        own = node.packed[: len(keys)]
        if own == keys:
            if self._lookup[slot] is not None:
                self._bind(slot, own, node)
            elif not node.full & self._mapped & ~(1 << slot):  # else the map binds the edge for another already
                self._bind(slot, own[before:], node)  # what the worker held before is bound already
            worker = self.worker_of(slot)
            self.hash_agreements[worker] = self.hash_agreements.get(worker, 0) + len(keys)
            return
        worker = self.worker_of(slot)
        differing = sum(a != b for a, b in zip(own, keys, strict=True))
        self.hash_mismatches[worker] = self.hash_mismatches.get(worker, 0) + differing
        if self._lookup[slot] is None:  # its keys are not the edge's: the map cannot say it holds them
            lookup = self._privatize(slot)
            for h in own[before:]:  # what the map says the store covered: under the worker's keys, bound next
                if lookup.get(h) is node:
                    del lookup[h]
        self._bind(slot, keys, node)

    def _reuse_parent_edge(self, node: Node, pos: int, packed: array[int], locs: array[int], bit: int,
                           slot: int) -> bool:
        """A store under a block in the middle or at the end of an edge that the edge already continues."""
        suffix_len = len(node.packed) - pos - 1
        n = len(packed)
        before = node.cutoff(slot)
        if n <= suffix_len:
            lo, hi = pos + 1, pos + 1 + n
            if node.packed[lo:hi] == packed and node.locals[lo:hi] == locs:
                node.cover_prefix(bit, slot, hi)
                self._covered(slot, node, before)
                self._bind(slot, node.packed[lo:hi], node)
                return True
            return False
        if node.internal:
            return False
        lo = pos + 1
        if node.packed[lo:] != packed[:suffix_len] or node.locals[lo:] != locs[:suffix_len]:
            return False
        self._append_to_leaf(node, packed[suffix_len:], locs[suffix_len:], bit, slot)
        self._covered(slot, node, before)
        self._bind(slot, node.packed[lo : lo + n], node)
        return True

    def _append_to_leaf(self, node: Node, added: array[int], locs: array[int], bit: int, slot: int) -> None:
        old = len(node.locals)
        if node.distinct and not native.u64s_distinct(node.packed + added):
            # A hash repeated in the edge: the map follows one place of it, its holders' lookups follow Dynamo's
            for s in (*iter_bits(node.full), *(node.cutoffs or ())):
                if self._lookup[s] is None and self._held_nodes[s] is not None:
                    self._privatize(s)
            node.distinct = False
        others = node.full & ~bit
        if others:
            if node.cutoffs is None:
                node.cutoffs = {}
            for s in iter_bits(others):
                node.cutoffs[s] = old
            node.full &= bit
        node.promote(bit, slot)
        node.locals.extend(locs)
        node.packed.extend(added)
        if node.index is not None:  # else built from the whole edge when first read
            node.index.update(zip(added, range(old, old + len(added)), strict=True))

    def _split(self, node: Node, pos: int) -> Node:
        """Cut `node`'s edge at `pos`; the suffix becomes its only child and takes its children."""
        # An edge not known distinct has its index built first: it tells a repeated hash, and the prefix
        # keeps what the suffix does not repeat. A distinct one's parts are distinct, their indexes lazy as its.
        distinct = node.distinct
        if not distinct and len(node.positions()) != len(node.packed):
            # A hash repeated in this edge: its holders' lookups can follow only one of its places.
            for s in (*iter_bits(node.full), *(node.cutoffs or ())):
                self._shadow(s)
        suffix_locs = node.locals[pos:]
        suffix_packed = node.packed[pos:]
        node.locals = node.locals[:pos]  # replaced, never cut in place: see Node
        node.packed = node.packed[:pos]
        index = node.index
        if index is not None:
            for h in suffix_packed:
                index.pop(h, None)
        suffix = Node(suffix_locs, suffix_packed, node, node.full, distinct=distinct)
        suffix.children, suffix.internal = node.children, node.internal
        if suffix.children:
            for child in suffix.children.values():
                child.parent = suffix
        partial = node.cutoffs
        if partial:
            keep: dict[int, int] = {}
            tail: dict[int, int] = {}
            for s, cut in partial.items():
                if cut < pos:
                    keep[s] = cut
                else:
                    node.full |= 1 << s
                    if cut > pos:
                        tail[s] = cut - pos
            node.cutoffs = keep or None
            suffix.cutoffs = tail or None
        node.internal = True
        lookups, held_nodes = self._lookup, self._held_nodes
        if suffix.has_workers():
            node.children = {suffix_locs[0]: suffix}
            if self.branches.kept:
                self.branches.moved(node, suffix)
            self.nodes += 1
            self._map.move(suffix_packed, node, suffix)
            moved = [(s, len(suffix_packed)) for s in iter_bits(suffix.full)]
            if suffix.cutoffs:
                moved.extend(suffix.cutoffs.items())
            for s, cut in moved:
                lookup = lookups[s]
                if lookup is not None:
                    self._bind(s, suffix_packed[:cut], suffix, node)
                elif (held := held_nodes[s]) is not None:
                    held.add(suffix)
                # else a removed worker's lingering bit (Dynamo panics here)
        else:
            node.children = None  # nobody holds the suffix: it is not kept (Dynamo keeps it, dead)
            if self.branches.kept:
                self.branches.dropped(node)
            self._map.move(suffix_packed, node, None)
        return suffix

    @property
    def debt(self) -> int:
        """Lookup and map entries of freed nodes not given back yet (see `remove` and `reclaim`): exact for the lookups,
        at most for the map (a freed node's hashes, some of which it may never have bound)."""
        return sum(map(len, self._garbage)) + sum(d.dead for d in self._deferred) + self._map.freed_entries

    def _after_loss(self, node: Node) -> None:
        """Dynamo clears the children of an edge nobody holds whole; kvctl also frees a node nobody holds."""
        if not node.full and node.children:
            for child in node.children.values():
                child.parent = None
            node.children = None
            if self.branches.kept:
                self.branches.dropped(node)
        if not node.has_workers():
            self.nodes -= 1
            node.freed = True
            self._map.note_freed(node)  # its entries: popped by `reclaim`, or by `remove` past a bound
            parent = node.parent
            if parent is not None:
                children = parent.children
                key = node.locals[0]
                if children and children.get(key) is node:
                    del children[key]
                    if self.branches.kept:
                        self.branches.released(parent, key)
                    if not children:
                        parent.children = None
                node.parent = None

    def clear(self, worker: WorkerKey) -> ApplyResult:
        """Drop every block of one (worker_id, dp_rank); the worker stays known (Dynamo's Cleared)."""
        slot = self._slots.get(worker)
        if slot is None:
            self._slot(worker)
            return OK_EMPTY
        self._drop_slot(slot)
        self._forget(slot, gone=False)
        self.hash_mismatches.pop(worker, None)
        self.hash_agreements.pop(worker, None)
        return OK_EMPTY

    def remove_worker(self, worker_id: int, dp_rank: int | None = None) -> int:
        """Forget a worker (all its dp ranks, or one); returns the blocks it held. O(its blocks)."""
        gone = [w for w in self._slots if selects((worker_id, dp_rank), w)]
        total = 0
        for w in gone:
            self.hash_mismatches.pop(w, None)
            self.hash_agreements.pop(w, None)
            slot = self._slots.pop(w)
            total += self._held(slot)
            self._drop_slot(slot)
            self._forget(slot, gone=True)
            if slot in self._shadows:
                self._ghosts[w] = slot
            else:
                self._workers[slot] = None
                self._retired += 1
        if self._retired > max(64, len(self._slots)):
            self._compact()
        return total

    def _compact(self) -> None:
        """Renumber slots so bitmasks stay as short as the live worker count.

        Removed workers' slots are never reused directly, so a new worker can never inherit a bit
        that lingers somewhere (see `_shadows`). Renumbering walks the whole tree, so it runs only once the
        retired slots outnumber the live ones, which keeps its cost amortised per removal.
        """
        live = [s for s, w in enumerate(self._workers) if w is not None]
        remap = {old: new for new, old in enumerate(live)}
        seen: set[int] = set()
        stack = [self.root, *(n for s in live for n in self._nodes_of(s) if not n.freed)]
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            node.full = sum(1 << remap[s] for s in iter_bits(node.full) if s in remap)
            if node.cutoffs:
                node.cutoffs = {remap[s]: c for s, c in node.cutoffs.items() if s in remap} or None
            if node.children:
                stack.extend(node.children.values())
        self._workers = [self._workers[s] for s in live]
        self._lookup = [self._lookup[s] for s in live]
        self._held_nodes = [self._held_nodes[s] for s in live]
        self._count = [self._count[s] for s in live]
        self._mapped = sum(1 << s for s, held in enumerate(self._held_nodes) if held is not None)
        self._deferred = [self._deferred[s] for s in live]
        self._slots = {w: remap[s] for w, s in self._slots.items()}
        self._ghosts = {w: remap[s] for w, s in self._ghosts.items()}
        self._shadows = {remap[s] for s in self._shadows}
        self._retired = 0

    def _nodes_of(self, slot: int) -> Iterable[Node]:
        """The nodes a worker's lookup points at (some more than once, some freed, for a lookup of its own)."""
        lookup = self._lookup[slot]
        return (self._held_nodes[slot] or ()) if lookup is None else lookup.values()

    def _forget(self, slot: int, *, gone: bool) -> None:
        """An emptied worker's lookup: none once removed; in the map again unless it turned shadow."""
        private = slot in self._shadows
        self._lookup[slot] = {} if private and not gone else None
        self._held_nodes[slot] = None if private or gone else set()
        self._count[slot] = 0
        self._mapped = self._mapped & ~(1 << slot) if private or gone else self._mapped | 1 << slot
        self._deferred[slot] = Deferred()

    def _drop_slot(self, slot: int) -> None:
        bit = 1 << slot
        seen: set[int] = set()
        for node in self._nodes_of(slot):
            if id(node) in seen:
                continue
            seen.add(id(node))
            if node.full & bit or (node.cutoffs and slot in node.cutoffs):
                node.drop(bit, slot)
                self._after_loss(node)

    # ----- views ---------------------------------------------------------------------------------------

    def walk(self) -> Iterator[tuple[Node, int | None]]:
        """Every node reachable from the root, breadth first, with its parent's last engine hash.

        A node's children are queued as one list copied when it is reached, not as an entry each: a dump
        walked in slices then does no per-child work at once, however many children a node (the root) has."""
        queue: deque[tuple[int | None, list[Node]]] = deque([(None, list((self.root.children or {}).values()))])
        while queue:
            parent_hash, children = queue.popleft()
            for node in children:
                yield node, parent_hash
                if node.children:
                    queue.append((node.packed[-1], list(node.children.values())))

    def worker_of(self, slot: int) -> WorkerKey:
        worker = self._workers[slot]
        assert worker is not None
        return worker

