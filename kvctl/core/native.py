"""The one place that picks how kvctl's hot loops run: the C extension (`_native.c`) where the install could
build it, else its pure-Python twin (`_native_py.py`), which gives the same results more slowly.

`KVCTL_PURE_PYTHON=1` picks the twin even where the extension exists, so the test suite and a suspicious
operator can run the fallback. It is read once, at import: a process's environment is its configuration, and
this is the only reading of it in `core/`. Callers look the functions up here at each call
(`native.xxh3_blocks(...)`), so tests can swap the implementation under them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from kvctl.core import _native_py

if TYPE_CHECKING:  # collections.abc.Buffer from Python 3.12 on
    from typing_extensions import Buffer


def _pick() -> tuple[ModuleType, bool]:
    if os.environ.get("KVCTL_PURE_PYTHON", "") not in ("", "0"):
        return _native_py, False
    try:
        from kvctl.core import _native
    except ImportError:  # built without a compiler (pip's `optional` extension): the twin stands in
        return _native_py, False
    return _native, True


class _Blocks(Protocol):
    def __call__(self, data: Buffer, stride: int, seed: int, window: int = ..., /) -> bytes: ...


_implementation, NATIVE = _pick()
"""NATIVE: whether the C extension is in use."""
IMPLEMENTATION = "C" if NATIVE else "none, pure Python"
"""In `kvctl --version`'s words: which speedups run."""

# Typed here because a module picked at run time is typed as any module: the twin's signatures, which both share.
xxh3_blocks: _Blocks = _implementation.xxh3_blocks
xxh3_chain: Callable[[Iterable[int], int], list[int]] = _implementation.xxh3_chain
u32_from_json: Callable[[Buffer], bytes] = _implementation.u32_from_json
u32_head_of_object: Callable[[Buffer], tuple[bytes, int] | None] = _implementation.u32_head_of_object
engine_batch_msgpack: Callable[[Buffer], tuple[int | float, int | None, list[tuple[int, tuple[Any, ...]]]]] = \
    _implementation.engine_batch_msgpack
bind_run: Callable[[dict[Any, Any], Iterable[Any], Any, Any], int] = _implementation.bind_run
u64s_distinct: Callable[[Buffer], bool] = _implementation.u64s_distinct
u64_counts: Callable[[Buffer], bytes] = _implementation.u64_counts
by_sequence: Callable[[dict[int, Any], int, int], _native_py.U64Map] = _implementation.by_sequence
solo_split: Callable[[Iterable[Any], int, int], tuple[bytes, list[Any], int]] = _implementation.solo_split
U64Map: type[_native_py.U64Map] = _implementation.U64Map
"""A dict of u64 keys to objects, the key in a 16 B slot: the index's engine hash -> node map (`block_map.py`)."""
FUNCTIONS = ("U64Map", "bind_run", "by_sequence", "engine_batch_msgpack", "solo_split", "u64_counts",
             "u64s_distinct", "xxh3_blocks", "xxh3_chain", "u32_from_json", "u32_head_of_object")
"""The names every implementation provides."""
