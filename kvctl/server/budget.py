"""How long one task may hold the event loop before it lets the others run.

Engines publish in bursts; a source or writer that worked through a whole burst in one go would hold
`/v1/route` (and every other request) for as long as the burst lasts. Work loops check the clock and
yield once their slice is spent: a route waits at most about a slice behind ingest.
"""

SLICE_S = 0.002

RECLAIM_ENTRIES = 2048
"""Freed index lookup entries given back per slice of the loop (`RadixTree.reclaim`): about 0.4 ms."""
