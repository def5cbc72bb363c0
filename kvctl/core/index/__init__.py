from kvctl.core.index.edges import Edge, edges
from kvctl.core.index.kv_index import IndexMatches, KvIndex, TierStats
from kvctl.core.index.radix import ApplyResult, Matches, RadixTree, Status

__all__ = [
    "ApplyResult",
    "Edge",
    "IndexMatches",
    "KvIndex",
    "Matches",
    "RadixTree",
    "Status",
    "TierStats",
    "edges",
]
