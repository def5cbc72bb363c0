"""Indexes keyed by model: each served model has its own block size, workers and tree."""

from __future__ import annotations

from kvctl.core.index.kv_index import KvIndex


class ModelIndexes(dict[str, KvIndex]):
    """`indexes[model]` creates the model's index on first use, as a router does on a model's first event."""

    def __missing__(self, model: str) -> KvIndex:
        index = self[model] = KvIndex()
        return index
