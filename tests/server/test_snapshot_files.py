"""Snapshot files: a checksummed trailer, the previous snapshot kept, a damaged file moved aside."""

from __future__ import annotations

import contextlib
import json
import resource
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.core.events.dump_file import read_router_events
from kvctl.server import snapshot
from kvctl.server.state import Fleet
from tests.fixtures_path import FIXTURES

DUMP = read_router_events((FIXTURES / "dynamo-1.6.1" / "dump.jsonl").read_text())


def fleet_with(events: int) -> Fleet:
    fleet = Fleet(block_size=16)
    fleet.apply("default", DUMP[:events], 0.0)
    return fleet


def blocks(fleet: Fleet) -> int:
    return int(fleet.stats()["models"]["default"]["blocks"])


def write(fleet: Fleet, state_dir: Path, taken_at: float) -> None:
    snapshot.write(snapshot.capture(fleet, taken_at), state_dir)


def test_each_write_keeps_the_one_before(tmp_path: Path) -> None:
    write(fleet_with(3), tmp_path, 1.0)
    write(fleet_with(7), tmp_path, 2.0)
    restored, problems = snapshot.restore(fresh := Fleet(block_size=16), tmp_path, 0.0)
    assert problems == [] and restored is not None and restored.taken_at == 2.0
    assert blocks(fresh) == blocks(fleet_with(7))
    assert json.loads((tmp_path / snapshot.PREVIOUS).read_text().splitlines()[0])["taken_at"] == 1.0


def test_a_write_cut_short_falls_back_to_the_previous_snapshot(tmp_path: Path) -> None:
    write(fleet_with(3), tmp_path, 1.0)
    write(fleet_with(7), tmp_path, 2.0)
    newest = tmp_path / snapshot.FILENAME
    newest.write_bytes(newest.read_bytes()[:-40])  # the trailer lost, as a crash without fsync would
    restored, problems = snapshot.restore(fresh := Fleet(block_size=16), tmp_path, 0.0)
    assert restored is not None and restored.path.name == snapshot.PREVIOUS and restored.taken_at == 1.0
    assert blocks(fresh) == blocks(fleet_with(3))
    assert len(problems) == 1 and "cut short" in problems[0]
    assert (tmp_path / f"{snapshot.FILENAME}.damaged").exists() and not newest.exists()


def test_a_flipped_byte_is_a_checksum_mismatch_and_nothing_of_it_is_applied(tmp_path: Path) -> None:
    write(fleet_with(7), tmp_path, 1.0)
    path = tmp_path / snapshot.FILENAME
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    restored, problems = snapshot.restore(fresh := Fleet(block_size=16), tmp_path, 0.0)
    assert restored is None and blocks(fresh) == 0 and "checksum mismatch" in problems[0]


def test_a_v1_snapshot_without_trailer_still_loads(tmp_path: Path) -> None:
    write(fleet_with(7), tmp_path, 1.0)
    path = tmp_path / snapshot.FILENAME
    lines = path.read_text().splitlines(keepends=True)
    header = json.loads(lines[0]) | {"schema": "kvctl.snapshot/v1"}
    path.write_text(json.dumps(header) + "\n" + "".join(lines[1:-1]))
    restored, problems = snapshot.restore(fresh := Fleet(block_size=16), tmp_path, 0.0)
    assert problems == [] and restored is not None and blocks(fresh) == blocks(fleet_with(7))


def test_a_write_that_runs_out_of_space_leaves_no_half_file_and_both_snapshots(tmp_path: Path) -> None:
    write(fleet_with(3), tmp_path, 1.0)
    write(fleet_with(5), tmp_path, 2.0)
    newest, previous = (tmp_path / snapshot.FILENAME).read_bytes(), (tmp_path / snapshot.PREVIOUS).read_bytes()
    (tmp_path / f".{snapshot.FILENAME}.12345.tmp").write_bytes(b"left by a killed process")
    # the kernel refuses the rest of the file (EFBIG), as a full disk would (ENOSPC)
    with file_size_limit(len(newest) // 2), pytest.raises(OSError):
        write(fleet_with(7), tmp_path, 3.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [snapshot.FILENAME, snapshot.PREVIOUS]
    assert (tmp_path / snapshot.FILENAME).read_bytes() == newest
    assert (tmp_path / snapshot.PREVIOUS).read_bytes() == previous


@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of killing the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
