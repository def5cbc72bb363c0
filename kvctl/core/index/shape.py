"""The device tree's shape as `kvctl tree stats` counts it, read edge by edge: what a router answers
`GET /v1/tree/stats?shape=true` from.

Counting a dump of the tree (`tree_stats.EdgeStats` over `KvIndex.capture_in_slices`) builds an edge, a node
and their holders' keys per tree node: ~130 µs a node, 10 s at 10M pairs, nearly all of it on the tails
that one worker holds. A node's figures need only where its edge starts (blocks above it), how many of its
blocks each holder holds, and, where two workers or more hold it, its local hashes and holders to rank and
name its shared prefixes. So this walk keeps runs, not nodes: (blocks above, blocks) counted once per edge
and once per holder, in `Counter`s whose keys repeat (prompt and tail lengths), and a `SharedEdge` only for
an edge two holders reach. A node one worker holds costs a few attribute reads and a counter's increment.

Holders are as a dump gives them (`capture_in_slices`): those holding the edge's whole path. The walk is
breadth first in the tree's own order (`RadixTree.walk`), numbering the shared edges in the order a dump
lists them, which ranks shared prefixes tied on holders, depth and local hash. Between two slices events may
apply: each edge is counted as it is when reached, with the holders its path had when its parent was.
"""

from __future__ import annotations

from array import array
from collections import Counter, deque
from collections.abc import Iterator

from kvctl.core import native
from kvctl.core.index.node import Node, iter_bits
from kvctl.core.index.radix import RadixTree
from kvctl.core.names import WorkerKey


class SharedEdge:
    """An edge two workers or more hold: what ranking and naming its shared prefixes takes."""

    __slots__ = ("above", "best_child", "holders", "length", "locals", "parent", "serial")

    def __init__(self, serial: int, above: int, holders: tuple[tuple[WorkerKey, int], ...], local_hashes: array[int],
                 length: int, parent: SharedEdge | None) -> None:
        self.serial = serial  # its place among shared edges, from 1, breadth first: it ranks tied prefixes
        self.above = above  # blocks above the edge
        self.holders = holders  # (worker, blocks of the edge it holds)
        self.locals = local_hashes  # the edge's local hashes: grow-only in place, so its first `length` stay
        self.length = length  # the most blocks a holder holds
        self.parent = parent
        self.best_child = 0  # the most holders a child edge has (0 for one: sharing needs two either way)


class TreeShape:
    """Runs and shared edges of the device tree, filled by `steps`."""

    def __init__(self, tree: RadixTree) -> None:
        self._tree = tree
        # (blocks above) << 32 | blocks, for each edge one worker holds whole: the bulk of a tree, counted in C
        self.solo: array[int] = array("Q")
        # The other edges: (blocks above, the most blocks a holder holds) -> edges, and
        # (blocks above, blocks held) -> (edge, holder) pairs
        self.blocks: Counter[tuple[int, int]] = Counter()
        self.held: Counter[tuple[int, int]] = Counter()
        self.shared: list[SharedEdge] = []  # breadth first: a parent before its children

    def steps(self, every: int) -> Iterator[None]:
        """The walk, pausing once it has taken about `every` edges, holders and children since the last pause (a
        prompt's edge may have a holder per worker and a child per request): a server lets its loop run there."""
        tree, solo, blocks, held, shared = self._tree, self.solo, self.blocks, self.held, self.shared
        # (slots holding the path above, blocks above, the parent's SharedEdge, the children as reached)
        queue: deque[tuple[int, int, SharedEdge | None, list[Node]]] = deque()
        if tree.root.children:
            queue.append((-1, 0, None, list(tree.root.children.values())))
        budget = every
        while queue:
            allowed, above, parent, children = queue.popleft()
            for start in range(0, len(children), every):  # `children`: a copy, as the tree may change at a pause
                # Those one worker holds whole (and no other in part), with all below them: runs, counted in C
                runs, rest, counted = native.solo_split(children[start : start + every], allowed, above)
                solo.frombytes(runs)
                budget -= counted
                if budget <= 0:
                    yield
                    budget = every
                for node in rest:
                    if budget <= 0:
                        yield
                        budget = every
                    budget -= 1
                    full = node.full & allowed
                    lengths = [(s, len(node.packed)) for s in iter_bits(full)]
                    if node.cutoffs:
                        lengths += [(s, k) for s, k in node.cutoffs.items() if allowed >> s & 1]
                    if not lengths:
                        continue
                    budget -= len(lengths)
                    longest = max(k for _, k in lengths)
                    blocks[(above, longest)] += 1
                    held.update((above, k) for _, k in lengths)
                    if parent is not None and parent.best_child < len(lengths):
                        parent.best_child = len(lengths)
                    edge = None
                    if len(lengths) > 1:
                        edge = SharedEdge(len(shared) + 1, above, tuple((tree.worker_of(s), k) for s, k in lengths),
                                          node.locals, longest, parent)
                        shared.append(edge)
                    if full and node.children:
                        budget -= len(node.children)
                        queue.append((full, above + len(node.packed), edge, list(node.children.values())))
