"""The image's body since schema v3: each model's index as runs of nodes (`core.index.bulk`), in binary frames.

A v2 image held one JSON Stored event per (edge, holder): a restart decoded every block of every holder and
walked it through the general `store`, ~2.2 s per million pairs. v3 keeps the JSON header line (so `head -1`
still reads it; `indexes` numbers each model's holders), then frames of `u32 length` (little-endian) and a
msgpack run whose hashes, lengths and holder masks are packed arrays in the writer's byte order (`byteorder` in
the header: a reader of the other order swaps them), a zero-length frame and a newline, and the trailer line
`{"end": {"bytes": N, "sha256": hex}}` over the N bytes before it. A reader takes frame kinds it knows by their
tag; a new section is a new tag, and the header a place for its metadata.
"""

from __future__ import annotations

import operator
import struct
import sys
from array import array
from collections.abc import Generator, Iterator
from typing import Annotated, Any

import msgspec

from kvctl.core.events import Tier
from kvctl.core.index.bulk import LowerRun, Runs, TreeRun, runs_of
from kvctl.core.index.kv_index import DumpEdge
from kvctl.core.words import counted

SCHEMA = "kvctl.snapshot/v3"
LENGTH = struct.Struct("<I")
END = LENGTH.pack(0) + b"\n"  # no frame follows; the trailer line does
SLICE_BYTES = 2 << 20  # read and checksummed between two yields of a restore
U64 = Annotated[int, msgspec.Meta(ge=0)]  # and < 2**64: checked by `_workers_of`


class _Device(msgspec.Struct, tag="device", array_like=True, gc=False):
    model: str
    first: int
    parents: bytes  # i64 each
    lengths: bytes  # u32 each
    hashes: bytes  # u64 each
    locals: bytes  # u64 each
    full: bytes  # `_mask_bytes` little-endian bytes per node
    cut_nodes: bytes  # u32 each
    cut_slots: bytes  # u32 each
    cut_lengths: bytes  # u32 each


class _Lower(msgspec.Struct, tag="lower", array_like=True, gc=False):
    model: str
    tier: Tier
    slots: bytes  # u32 each
    parents: bytes  # u64 each, 0 where `rooted`
    rooted: bytes  # one byte each: 1 for a block stored at the root
    blocks: bytes  # u64 each
    locals: bytes  # u64 each


_Frame = _Device | _Lower
_encoder = msgspec.msgpack.Encoder()
_decode_frame = msgspec.msgpack.Decoder(_Frame).decode


class Index(msgspec.Struct):
    """A model's entry in the header's `indexes`: its holders (the runs' worker numbers), the device's first."""

    workers: list[tuple[U64, Annotated[int, msgspec.Meta(ge=0, lt=2**32)]]]
    device_workers: Annotated[int, msgspec.Meta(ge=0)]


def _mask_bytes(device_workers: int) -> int:
    return max(1, (device_workers + 7) // 8)


def encode(models: list[tuple[str, list[DumpEdge]]]) -> tuple[dict[str, Any], Iterator[bytes]]:
    """The header's additions (`indexes`, `byteorder`) and the frames, for a capture's models."""
    indexes: dict[str, Any] = {}
    frames: list[tuple[str, Runs]] = []
    for name, edges in models:
        runs = runs_of(edges)
        indexes[name] = {"workers": runs.workers, "device_workers": runs.device_workers}
        frames.append((name, runs))
    return {"byteorder": sys.byteorder, "indexes": indexes}, _frames(frames)


def _frames(models: list[tuple[str, Runs]]) -> Iterator[bytes]:
    for name, runs in models:
        width = _mask_bytes(runs.device_workers)
        for run in runs.runs:
            if isinstance(run, TreeRun):
                frame: _Frame = _Device(name, run.first, run.parents.tobytes(), run.lengths.tobytes(),
                                        run.hashes.tobytes(), run.locals.tobytes(),
                                        b"".join(m.to_bytes(width, "little") for m in run.full),
                                        run.cut_nodes.tobytes(), run.cut_slots.tobytes(), run.cut_lengths.tobytes())
            else:
                frame = _Lower(name, run.tier, run.slots.tobytes(),
                               array("Q", [p or 0 for p in run.parents]).tobytes(),
                               bytes(p is None for p in run.parents), run.blocks.tobytes(), run.locals.tobytes())
            payload = _encoder.encode(frame)
            yield LENGTH.pack(len(payload)) + payload
    yield END


def body_in_slices(data: memoryview, at: int, header: dict[str, Any],
                   models: dict[str, int]) -> Generator[int, None, dict[str, Runs]]:
    """The frames of a checksummed file from byte `at` on, decoded and checked whole (ValueError naming the
    first problem), yielding the offset reached after each; every model's runs."""
    try:
        indexes = msgspec.convert(header.get("indexes", {}), dict[str, Index])
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad header: indexes: {exc}") from None
    swap = header.get("byteorder", sys.byteorder) != sys.byteorder
    out: dict[str, Runs] = {}
    for name, index in indexes.items():
        if name not in models:
            raise ValueError(f"bad header: the index of {name!r} is not among the models")
        if index.device_workers > len(index.workers) or any(w >= 2**64 for w, _ in index.workers):
            raise ValueError(f"bad header: the index of {name!r} has bad workers")
        out[name] = Runs([(w, r) for w, r in index.workers], index.device_workers, [])
    placed = dict.fromkeys(out, 0)  # nodes read so far, per model
    n = 0
    while True:
        n += 1
        if at + LENGTH.size > len(data):
            raise ValueError("the frames run past the trailer")
        (length,) = LENGTH.unpack_from(data, at)
        at += LENGTH.size
        if length == 0:
            if bytes(data[at:]) != b"\n":
                raise ValueError("bytes after the last frame")
            return out
        try:
            frame = _decode_frame(data[at:at + length])
            runs = out.get(frame.model)
            if runs is None:
                raise ValueError(f"model {frame.model!r} has no index in the header")
            run = _run_of(frame, swap, runs)
            if isinstance(run, TreeRun):
                _check_tree(run, placed[frame.model], runs.device_workers)
                placed[frame.model] += len(run.lengths)
            else:
                _check_lower(run, len(runs.workers))
        except (msgspec.DecodeError, ValueError) as exc:
            raise ValueError(f"frame {n} (byte {at - LENGTH.size}): {exc}") from None
        runs.runs.append(run)
        at += length
        yield at


def _array(code: str, data: bytes, swap: bool) -> array[int]:
    out = array(code)
    out.frombytes(data)  # ValueError: not a whole number of items
    if swap:
        out.byteswap()
    return out


def _run_of(frame: _Frame, swap: bool, runs: Runs) -> TreeRun | LowerRun:
    if isinstance(frame, _Lower):
        rooted = frame.rooted
        parents = _array("Q", frame.parents, swap)
        if len(rooted) != len(parents):
            raise ValueError("rooted and parents differ in length")
        return LowerRun(frame.tier, _array("I", frame.slots, swap),
                        [None if r else p for r, p in zip(rooted, parents, strict=True)],
                        _array("Q", frame.blocks, swap), _array("Q", frame.locals, swap))
    width = _mask_bytes(runs.device_workers)
    full = frame.full
    if len(full) % width:
        raise ValueError("holder masks are not whole")
    return TreeRun(frame.first, _array("q", frame.parents, swap), _array("I", frame.lengths, swap),
                   _array("Q", frame.hashes, swap), _array("Q", frame.locals, swap),
                   [int.from_bytes(full[i:i + width], "little") for i in range(0, len(full), width)],
                   _array("I", frame.cut_nodes, swap), _array("I", frame.cut_slots, swap),
                   _array("I", frame.cut_lengths, swap))


def _check_tree(run: TreeRun, first: int, device_workers: int) -> None:
    """What `Builder` takes for granted: nodes in order, parents before them, held by known workers."""
    n = len(run.lengths)
    if run.first != first:
        raise ValueError(f"nodes from {run.first}, expected from {first}")
    if len(run.parents) != n or len(run.full) != n:
        raise ValueError("parents, lengths and holders differ in length")
    if n and (min(run.lengths) < 1 or min(run.parents) < -1):
        raise ValueError("an empty edge, or a parent out of range")
    if sum(run.lengths) != len(run.hashes) or len(run.locals) != len(run.hashes):
        raise ValueError("the hashes do not add up to the edges' lengths")
    if not all(map(operator.lt, run.parents, range(first, first + n))):
        raise ValueError("a node before its parent")
    limit = 1 << device_workers
    if not all(0 < m < limit for m in run.full):
        raise ValueError("a node held by no worker whole, or by an unknown one")
    cuts = len(run.cut_nodes)
    if len(run.cut_slots) != cuts or len(run.cut_lengths) != cuts:
        raise ValueError("partial holders differ in length")
    for node, slot, k in zip(run.cut_nodes, run.cut_slots, run.cut_lengths, strict=True):
        if not (first <= node < first + n and slot < device_workers and 0 < k < run.lengths[node - first]):
            raise ValueError(f"a partial holder out of range (node {node}, worker {slot}, {counted(k, 'block')})")


def _check_lower(run: LowerRun, workers: int) -> None:
    n = len(run.blocks)
    if len(run.slots) != n or len(run.locals) != n:
        raise ValueError("lower-tier columns differ in length")
    if n and max(run.slots) >= workers:
        raise ValueError("a lower-tier block of an unknown worker")
