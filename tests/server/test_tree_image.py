"""The v3 image (`tree_image`): each model's index as runs of nodes, built back in bulk on restore."""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvctl.core.events import RouterEvent, Stored, Tier
from kvctl.core.index import KvIndex, bulk
from kvctl.server.persistence import snapshot, tree_image
from kvctl.server.state import Fleet
from tests.server import v2_image
from tests.server.test_snapshot_files import DUMP, fingerprint, fleet_with


def chains(fleet: Fleet, count: int, blocks: int = 64, tier: Tier = Tier.device) -> None:
    """`count` chains from the root on 8 workers, each after the first sharing the first's first half."""
    shared = list(range(1, blocks // 2 + 1))
    for n in range(count):
        own = [10_000 * (n + 1) + b for b in range(blocks // 2)]
        hashes = [*shared, *own] if n else [*shared, *(b + 5_000 for b in own)]
        event = Stored(None, [h * 7 for h in hashes], array("Q", hashes), tier)
        fleet.apply("default", [RouterEvent(n % 8, event, 0, n)], 0.0)


def index_of(fleet: Fleet) -> KvIndex:
    return fleet.models["default"].router.index


def restored(state_dir: Path) -> tuple[Fleet, snapshot.Restored | None, list[str]]:
    fresh = Fleet(block_size=16)
    image, problems = snapshot.restore(fresh, state_dir, 0.0)
    return fresh, image, problems


def test_an_image_restores_the_index_and_its_slower_tiers(tmp_path: Path) -> None:
    fleet = fleet_with(len(DUMP))
    chains(fleet, 20)
    chains(fleet, 6, tier=Tier.host_pinned)
    snapshot.write(snapshot.capture(fleet, 1.0), tmp_path)
    fresh, image, problems = restored(tmp_path)
    assert problems == [] and image is not None
    assert fingerprint(fresh) == fingerprint(fleet)
    assert fresh.stats() == fleet.stats()
    query = [*range(1, 33), *(10_000 + b for b in range(32))]
    assert index_of(fresh).find_matches(query) == index_of(fleet).find_matches(query)
    v2_image.write(fleet, replayed_dir := tmp_path / "v2", 1.0)
    by_events, v2, _ = restored(replayed_dir)
    assert v2 is not None and image.events == v2.events  # one per (edge, holder), as a replay counts them
    assert fresh.models["default"].applied == by_events.models["default"].applied


def test_a_restore_builds_a_run_at_a_time(tmp_path: Path) -> None:
    fleet = Fleet(block_size=16)
    chains(fleet, 3 * bulk.RUN_PAIRS // 32)  # 32 pairs of its own each
    snapshot.write(snapshot.capture(fleet, 1.0), tmp_path)
    steps = snapshot.restore_in_slices(fresh := Fleet(block_size=16), tmp_path, 0.0)
    phases = [p.phase for p in steps]
    assert phases.count("building the index") >= 3, phases  # each run a slice of the loop: ~4k pairs at most
    assert phases.count("reading the image") >= 1 and phases.count("decoding the image") >= 3
    assert fingerprint(fresh) == fingerprint(fleet)
    runs = bulk.runs_of(index_of(fleet).capture()).runs
    assert all(bulk.pairs_of([run]) <= bulk.RUN_PAIRS for run in runs)  # holders weigh, not only blocks


def test_an_index_the_builder_cannot_take_is_replayed_event_by_event(tmp_path: Path) -> None:
    fleet = Fleet(block_size=16)
    fleet.apply("default", [RouterEvent(1, Stored(None, [5, 6, 5], [101, 102, 103]), 0, 0)], 0.0)  # a hash twice
    chains(fleet, 3)
    assert not bulk.build(KvIndex(), bulk.runs_of(index_of(fleet).capture()))
    snapshot.write(snapshot.capture(fleet, 1.0), tmp_path)
    fresh, image, problems = restored(tmp_path)
    v2_image.write(fleet, replayed_dir := tmp_path / "v2", 1.0)
    by_events, v2, _ = restored(replayed_dir)
    assert problems == [] and image is not None and v2 is not None and image.events == v2.events == 7
    assert fingerprint(fresh) == fingerprint(by_events) == fingerprint(fleet)


def rewritten(path: Path, change: Callable[[Any], dict[str, Any]]) -> None:
    """The image's first frame with `change(frame)`, its trailer made to match: only the content is wrong."""
    data = path.read_bytes()
    header_end = data.index(b"\n") + 1
    (length,) = tree_image.LENGTH.unpack_from(data, header_end)
    start = header_end + tree_image.LENGTH.size
    frame = tree_image._decode_frame(data[start:start + length])
    frame = msgspec.structs.replace(frame, **change(frame))
    payload = msgspec.msgpack.encode(frame)
    body = data[:header_end] + tree_image.LENGTH.pack(len(payload)) + payload + data[start + length:]
    body = body[:body.rindex(b"\n", 0, len(body) - 1) + 1]  # the trailer off
    trailer = {"end": {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}}
    path.write_bytes(body + json.dumps(trailer).encode() + b"\n")


@pytest.mark.parametrize(("change", "needle"), [
    (lambda f: {"parents": array("q", [len(f.parents) // 8] * (len(f.parents) // 8)).tobytes()},
     "a node before its parent"),
    (lambda f: {"lengths": b"\x01\x00\x00"}, "not a multiple of item size"),
    (lambda f: {"full": bytes(len(f.full))}, "held by no worker whole"),
    (lambda f: {"hashes": b""}, "do not add up"),
    (lambda f: {"model": "gpt"}, "no index in the header"),
    (lambda f: {"first": 3}, "expected from 0"),
])
def test_a_frame_that_passes_the_checksum_but_not_the_checks_falls_back(
        tmp_path: Path, change: Callable[[Any], dict[str, Any]], needle: str) -> None:
    snapshot.write(snapshot.capture(fleet_with(3), 1.0), tmp_path)
    snapshot.write(snapshot.capture(fleet_with(len(DUMP)), 2.0), tmp_path)
    rewritten(tmp_path / snapshot.FILENAME, change)
    fresh, image, problems = restored(tmp_path)
    assert image is not None and image.path.name == snapshot.PREVIOUS and len(problems) == 1
    assert f"{snapshot.FILENAME}: frame 1 (byte " in problems[0] and needle in problems[0], problems
    assert fingerprint(fresh) == fingerprint(fleet_with(3))  # nothing of the damaged one
    assert (tmp_path / f"{snapshot.FILENAME}.damaged").exists()
