"""One radix tree of KV blocks per (model, tier): Dynamo 1.6.1's single-threaded index, leak fixed.

Semantics are Dynamo's `RadixTree` (lib/kv-router, the version in ai-dynamo-runtime 1.6.1), which is
the arbiter of scores (docs/contract.md). That tree compresses runs of blocks into edges and records, per
edge, which workers hold all of it (`full`) and which hold only a prefix (`cutoffs`). The edge
boundaries are part of its observable behaviour: removing a block cuts the worker off at that point
of the edge (the rest of the edge becomes stale for it) but not in child nodes. So kvctl keeps the
same edges, splits and leaf extensions rather than one node per block.

Where kvctl differs on purpose: a node no worker holds any more is detached from its parent and
freed (Dynamo keeps it in its parent's children forever: the leak fixed upstream by PR #11678).

Python-specific choices, all for speed and memory (see benchmarks/index_bench.py):
- worker keys `(worker_id, dp_rank)` map to small slot numbers; a node's full holders are one int
  bitmask, so find_matches intersects holders with one `&` per edge;
- an edge keeps its local hashes in an `array('Q')`: matching a query against an edge is one
  C-level slice comparison, and storing N blocks touches each block only inside C loops;
- an edge keeps its engine hashes as the int objects the event brought, and every worker's lookup
  reuses those same objects as keys where its hashes are equal: one int per block, not one per holder;
- it keeps them packed too (`array('Q')`, 8 B a block): a removal, which may come packed from the
  router's decode process, checks a run of an edge with one C comparison and never touches the run's
  int objects, which are cold by then (one cache miss each, the larger part of a removal's cost).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat

from kvctl.core import native
from kvctl.core.index import removal
from kvctl.core.index.node import OK_EMPTY, ApplyResult, Deferred, Node, Status, iter_bits
from kvctl.core.names import WorkerKey, selects

__all__ = ["OK_EMPTY", "ApplyResult", "Matches", "Node", "RadixTree", "Status", "iter_bits"]


@dataclass(slots=True)
class Matches:
    """find_matches' answer: contiguous matched depth per worker, and its tree size."""

    scores: dict[WorkerKey, int] = field(default_factory=dict)
    tree_sizes: dict[WorkerKey, int] = field(default_factory=dict)


class RadixTree:
    """The index of one tier of one model. Single writer; `find_matches` is read-only."""

    def __init__(self) -> None:
        self.root = Node(array("Q"), [], None, 0)
        self.root.internal = True
        self._slots: dict[WorkerKey, int] = {}
        self._workers: list[WorkerKey | None] = []  # slot -> worker key; None once removed
        self._retired = 0
        # Slots whose lookup once lost track of a node that still carries their bit (a worker that
        # stored one block hash at two places). Dynamo keeps crediting such a node to the
        # worker, even after remove_worker and back, so those slots keep their worker's identity.
        self._shadows: set[int] = set()
        self._ghosts: dict[WorkerKey, int] = {}  # removed workers whose bits may linger -> their slot
        self._lookup: list[dict[int, Node] | None] = []  # slot -> engine block hash -> node
        self._deferred: list[Deferred] = []  # slot -> what its lookup still holds of freed nodes: see `remove`
        self._garbage: list[dict[int, Node]] = []  # lookups of workers that let go of everything: see `reclaim`
        self.nodes = 0
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
                self._lookup.append({})
                self._deferred.append(Deferred())
            else:
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
        """Blocks the slot holds: Dynamo's per-worker lookup size, less the entries kvctl lets go lazily."""
        return len(self._lookup[slot] or ()) - self._deferred[slot].dead

    def sizes(self) -> dict[WorkerKey, int]:
        return {w: self._held(s) for w, s in self._slots.items()}

    @property
    def blocks(self) -> int:
        """(worker, block) pairs held: Dynamo's `current_size`."""
        return sum(len(lk) for lk in self._lookup if lk) - sum(d.dead for d in self._deferred)

    # ----- matching ------------------------------------------------------------------------------------

    def find_matches(self, local_hashes: Sequence[int], *, early_exit: bool = False) -> Matches:
        """Contiguous matched depth, in blocks, of every worker holding a prefix of `local_hashes`."""
        result = Matches()
        n = len(local_hashes)
        if not n:
            return result
        children = self.root.children
        node = children.get(local_hashes[0]) if children else None
        if node is None:
            return result
        q = local_hashes if isinstance(local_hashes, array) else array("Q", local_hashes)
        slot_scores: dict[int, int] = {}
        depth = 0
        active = 0
        first = True
        while True:
            edge = node.locals
            walk = min(len(edge), n - depth)
            if edge[:walk] == q[depth : depth + walk] if walk < len(edge) else edge == q[depth : depth + walk]:
                m = walk
            else:
                m = _common_prefix(edge, q, depth, walk)
            if first:
                active = node.full
                if node.cutoffs:
                    for slot, cut in node.cutoffs.items():
                        slot_scores[slot] = cut if cut < m else m
                first = False
            else:
                dropped = active & ~node.full
                if dropped:
                    cutoffs = node.cutoffs
                    slot_scores.update(dict.fromkeys(iter_bits(dropped), depth))
                    if cutoffs:
                        for slot, cut in cutoffs.items():
                            if dropped >> slot & 1:
                                slot_scores[slot] = depth + (cut if cut < m else m)
                    active &= node.full
            depth += m
            if not active or m < len(edge) or depth == n or (early_exit and active & (active - 1) == 0):
                break
            children = node.children
            node = children.get(q[depth]) if children else None
            if node is None:
                break
        if active:
            slot_scores.update(dict.fromkeys(iter_bits(active), depth))
        workers, lookup, deferred = self._workers, self._lookup, self._deferred
        result.scores = {workers[s]: score for s, score in slot_scores.items()}  # type: ignore[misc]
        # `_held`, inlined: a route asks it of every matched worker
        result.tree_sizes = {workers[s]: len(lookup[s] or ()) - deferred[s].dead  # type: ignore[misc]
                             for s in slot_scores}
        return result

    def path_hashes(self, local_hashes: Sequence[int], depths: set[int]) -> dict[int, int]:
        """For each depth d, the engine hash the tree keeps for block d-1 of the path `local_hashes` walks.

        Where a slower tier's walk starts from (Dynamo's `last_matched_hashes`); only depths the path reaches
        (matched ones) are answered. The node's hash is the first storer's: engines that hash the same tokens
        alike (all do, but see `hash_mismatches`) share it."""
        wanted = sorted(d for d in depths if d > 0)
        out: dict[int, int] = {}
        node, depth, i = self.root, 0, 0
        while i < len(wanted) and depth < len(local_hashes):
            children = node.children
            node = children.get(local_hashes[depth]) if children else None  # type: ignore[assignment]
            if node is None:
                break
            end = depth + len(node.locals)
            while i < len(wanted) and wanted[i] <= end:
                out[wanted[i]] = node.hashes[wanted[i] - depth - 1]
                i += 1
            depth = end
        return out

    # ----- mutation ------------------------------------------------------------------------------------

    def store(self, worker: WorkerKey, parent_hash: int | None, block_hashes: Sequence[int],
              tokens_hashes: Sequence[int]) -> ApplyResult:
        slot = self._slot(worker)
        bit = 1 << slot
        lookup = self._lookup[slot]
        assert lookup is not None
        hashes = block_hashes if type(block_hashes) is list else list(block_hashes)
        locs = tokens_hashes if isinstance(tokens_hashes, array) else array("Q", tokens_hashes)
        nblocks = len(hashes)
        packed = array("Q", hashes)  # what the run's new edge keeps (`Node.packed`), and told distinct in C
        distinct = native.u64s_distinct(packed)
        if not distinct:  # one hash at two places: a lookup key can name only one of them
            self._shadow(slot)
        if parent_hash is None:
            parent = self.root
        else:
            if parent_hash in hashes:
                return ApplyResult(Status.invalid_block)
            node = lookup.get(parent_hash)
            pos = node.position(parent_hash) if node is not None else None
            if node is None or pos is None:
                return ApplyResult(Status.parent_block_not_found)
            if not node.covers(slot, pos):
                del lookup[parent_hash]
                if node.freed and slot not in self._shadows:
                    self._deferred[slot].dead -= 1
                if node.cutoff(slot):  # a duplicate hash resolved past what the worker holds of the edge
                    self._shadow(slot)
                return ApplyResult(Status.parent_block_not_found)
            if self._reuse_parent_edge(node, pos, hashes, locs, bit, slot, lookup):
                return ApplyResult(Status.ok, nblocks)
            if pos + 1 != len(node.hashes):
                self._split(node, pos + 1)
            parent = node
        start = 0
        while start < nblocks:
            children = parent.children
            child = children.get(locs[start]) if children else None
            if child is None:
                if not parent.internal and parent.locals and parent.full & bit:
                    self._append_to_leaf(parent, hashes[start:], locs[start:], bit, slot)
                    self._bind(slot, lookup, hashes[start:], parent)
                    break
                child = Node(locs[start:], hashes[start:], parent, bit, packed[start:], distinct=distinct)
                self.nodes += 1
                if children is None:
                    parent.children = {locs[start]: child}
                else:
                    children[locs[start]] = child
                parent.internal = True
                self._bind(slot, lookup, hashes[start:], child)
                break
            edge = child.locals
            elen = len(edge)
            rest = nblocks - start
            walk = elen if elen < rest else rest
            m = walk if edge[:walk] == locs[start : start + walk] else _common_prefix(edge, locs, start, walk)
            if m < elen:
                if m == rest:
                    child.cover_prefix(bit, slot, m)
                    self._bind_shared(slot, lookup, hashes[start:], child)
                    break
                self._split(child, m)
                child.promote(bit, slot)
                self._bind_shared(slot, lookup, hashes[start : start + m], child)
                start += m
                tail = Node(locs[start:], hashes[start:], child, bit, packed[start:], distinct=distinct)
                self.nodes += 1
                if child.children is None:
                    child.children = {locs[start]: tail}
                else:
                    child.children[locs[start]] = tail
                child.internal = True
                self._bind(slot, lookup, hashes[start:], tail)
                break
            child.promote(bit, slot)
            self._bind_shared(slot, lookup, hashes[start : start + elen], child)
            start += elen
            parent = child
        return ApplyResult(Status.ok, nblocks)

    def _bind(self, slot: int, lookup: dict[int, Node], keys: list[int], node: Node,
              moving_from: Node | None = None) -> None:
        """Point `keys` of a worker's lookup at `node`, noting when that takes one away from another node.

        Usually no key is bound elsewhere: `native.bind_run` binds the run while it checks that, one probe of
        the lookup a key, and leaves the keys from the first one bound elsewhere to the loop here."""
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

    def _shadow(self, slot: int) -> None:
        """Note a slot whose lookup lost track of a node; its entries are let go one by one from now on.

        Lazily let-go entries (see `remove`) rely on the lookup naming each held block exactly once, so
        a slot that turns shadow drops them first.
        """
        if slot in self._shadows:
            return
        self._shadows.add(slot)
        deferred = self._deferred[slot]
        if deferred.nodes:
            lookup = self._lookup[slot]
            assert lookup is not None
            for h in [h for h, node in lookup.items() if node.freed]:
                del lookup[h]
            self._deferred[slot] = Deferred()

    def _bind_shared(self, slot: int, lookup: dict[int, Node], keys: list[int], node: Node) -> None:
        """Bind keys to `node`'s first edge positions, reusing the node's own int objects where equal."""
        own = node.hashes[: len(keys)]
        if own == keys:
            self._bind(slot, lookup, own, node)
            worker = self.worker_of(slot)
            self.hash_agreements[worker] = self.hash_agreements.get(worker, 0) + len(keys)
            return
        worker = self.worker_of(slot)
        differing = sum(a != b for a, b in zip(own, keys, strict=True))
        self.hash_mismatches[worker] = self.hash_mismatches.get(worker, 0) + differing
        self._bind(slot, lookup, keys, node)

    def _reuse_parent_edge(self, node: Node, pos: int, hashes: list[int], locs: array[int], bit: int, slot: int,
                           lookup: dict[int, Node]) -> bool:
        """A store under a block in the middle or at the end of an edge that the edge already continues."""
        suffix_len = len(node.hashes) - pos - 1
        n = len(hashes)
        if n <= suffix_len:
            lo, hi = pos + 1, pos + 1 + n
            if node.hashes[lo:hi] == hashes and node.locals[lo:hi] == locs:
                node.cover_prefix(bit, slot, hi)
                self._bind(slot, lookup, node.hashes[lo:hi], node)
                return True
            return False
        if node.internal:
            return False
        lo = pos + 1
        if node.hashes[lo:] != hashes[:suffix_len] or node.locals[lo:] != locs[:suffix_len]:
            return False
        self._append_to_leaf(node, hashes[suffix_len:], locs[suffix_len:], bit, slot)
        self._bind(slot, lookup, node.hashes[lo : lo + n], node)
        return True

    def _append_to_leaf(self, node: Node, hashes: list[int], locs: array[int], bit: int, slot: int) -> None:
        old = len(node.locals)
        others = node.full & ~bit
        if others:
            if node.cutoffs is None:
                node.cutoffs = {}
            for s in iter_bits(others):
                node.cutoffs[s] = old
            node.full &= bit
        node.promote(bit, slot)
        node.distinct = False  # the new hashes may repeat old ones: asked of the index from now on
        node.locals.extend(locs)
        node.hashes.extend(hashes)
        node.packed.extend(hashes)
        if node.index is not None:  # else built from the whole edge when first read
            node.index.update(zip(hashes, range(old, old + len(hashes)), strict=True))

    def _split(self, node: Node, pos: int) -> Node:
        """Cut `node`'s edge at `pos`; the suffix becomes its only child and takes its children."""
        # An edge not known distinct has its index built first: it tells a repeated hash, and the prefix
        # keeps what the suffix does not repeat. A distinct one's parts are distinct, their indexes lazy as its.
        distinct = node.distinct
        if not distinct and len(node.positions()) != len(node.hashes):
            # A hash repeated in this edge: its holders' lookups can follow only one of its places.
            for s in (*iter_bits(node.full), *(node.cutoffs or ())):
                self._shadow(s)
        suffix_hashes = node.hashes[pos:]
        suffix_locs = node.locals[pos:]
        suffix_packed = node.packed[pos:]
        node.hashes = node.hashes[:pos]  # replaced, never cut in place: see Node
        node.locals = node.locals[:pos]
        node.packed = node.packed[:pos]
        index = node.index
        if index is not None:
            for h in suffix_hashes:
                index.pop(h, None)
        suffix = Node(suffix_locs, suffix_hashes, node, node.full, suffix_packed, distinct=distinct)
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
        lookups = self._lookup
        if suffix.has_workers():
            node.children = {suffix_locs[0]: suffix}
            self.nodes += 1
            moved = [(s, len(suffix_hashes)) for s in iter_bits(suffix.full)]
            if suffix.cutoffs:
                moved.extend(suffix.cutoffs.items())
            for s, cut in moved:
                lookup = lookups[s]
                if lookup is not None:  # None: a removed worker's lingering bit (Dynamo panics here)
                    self._bind(s, lookup, suffix_hashes[:cut], suffix, node)
        else:
            node.children = None  # nobody holds the suffix: it is not kept (Dynamo keeps it, dead)
        return suffix

    def remove(self, worker: WorkerKey, block_hashes: Sequence[int]) -> ApplyResult:
        """Let the worker go of blocks, Dynamo's way; a node nobody holds any more is freed (`removal.remove`)."""
        return removal.remove(self, worker, block_hashes)


    @property
    def debt(self) -> int:
        """Lookup entries of freed nodes not given back yet (see `remove` and `reclaim`)."""
        return sum(map(len, self._garbage)) + sum(d.dead for d in self._deferred)
    def reclaim(self, budget: int) -> bool:
        """Give back about `budget` entries of freed nodes' memory; True while there is more (`removal.reclaim`)."""
        return removal.reclaim(self, budget)


    def _after_loss(self, node: Node) -> None:
        """Dynamo clears the children of an edge nobody holds whole; kvctl also frees a node nobody holds."""
        if not node.full and node.children:
            for child in node.children.values():
                child.parent = None
            node.children = None
        if not node.has_workers():
            self.nodes -= 1
            node.freed = True
            parent = node.parent
            if parent is not None:
                children = parent.children
                key = node.locals[0]
                if children and children.get(key) is node:
                    del children[key]
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
        self._lookup[slot] = {}
        self._deferred[slot] = Deferred()
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
            self._lookup[slot] = None
            self._deferred[slot] = Deferred()
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
        stack = [self.root] + [n for s in live for n in (self._lookup[s] or {}).values() if not n.freed]
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
        self._deferred = [self._deferred[s] for s in live]
        self._slots = {w: remap[s] for w, s in self._slots.items()}
        self._ghosts = {w: remap[s] for w, s in self._ghosts.items()}
        self._shadows = {remap[s] for s in self._shadows}
        self._retired = 0

    def _drop_slot(self, slot: int) -> None:
        bit = 1 << slot
        seen: set[int] = set()
        for node in (self._lookup[slot] or {}).values():
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
                    queue.append((node.hashes[-1], list(node.children.values())))

    def worker_of(self, slot: int) -> WorkerKey:
        worker = self._workers[slot]
        assert worker is not None
        return worker


def _common_prefix(edge: array[int], q: Sequence[int], start: int, walk: int) -> int:
    """Length of the longest common prefix of edge[:walk] and q[start:start+walk] (binary search on slices)."""
    lo, hi = 0, walk
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if edge[:mid] == q[start : start + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
