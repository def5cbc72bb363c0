"""Snapshot files: a checksummed trailer, the previous snapshot kept, a damaged file moved aside.

The checks of a file's lines are of v2 images (`v2_image`), which state dirs in the field hold; those of the
v3 image's frames are in test_tree_image.py."""

from __future__ import annotations

import contextlib
import json
import resource
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvctl.core.events.dump_file import read_router_events
from kvctl.server.persistence import snapshot
from kvctl.server.state import Fleet
from kvctl.server.worker_info import WorkerInfo
from tests.fixtures_path import FIXTURES
from tests.fuzz.junk import JSON_JUNK, mutated, replaced
from tests.server import v2_image
from tests.server.test_serve_process import _stop, serving

DUMP = read_router_events((FIXTURES / "dynamo-1.6.1" / "dump.jsonl").read_text())


def fleet_with(events: int) -> Fleet:
    fleet = Fleet(block_size=16)
    fleet.apply("default", DUMP[:events], 0.0)
    return fleet


def blocks(fleet: Fleet) -> int:
    return fleet.stats().models["default"].blocks


def write(fleet: Fleet, state_dir: Path, taken_at: float) -> None:
    snapshot.write(snapshot.capture(fleet, taken_at), state_dir)


def test_each_write_keeps_the_one_before(tmp_path: Path) -> None:
    write(fleet_with(3), tmp_path, 1.0)
    write(fleet_with(7), tmp_path, 2.0)
    restored, problems = snapshot.restore(fresh := Fleet(block_size=16), tmp_path, 0.0)
    assert problems == [] and restored is not None and restored.taken_at == 2.0
    assert blocks(fresh) == blocks(fleet_with(7))
    assert json.loads((tmp_path / snapshot.PREVIOUS).read_bytes().split(b"\n")[0])["taken_at"] == 1.0


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
    body = data.index(b"\n") + 1  # past the header line, which is JSON: a flip there makes it unreadable
    data[(body + len(data)) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    restored, problems = snapshot.restore(fresh := Fleet(block_size=16), tmp_path, 0.0)
    assert restored is None and blocks(fresh) == 0 and "checksum mismatch" in problems[0]


def test_a_v2_snapshot_still_loads(tmp_path: Path) -> None:
    v2_image.write(fleet_with(7), tmp_path, 1.0)
    restored, problems = snapshot.restore(fresh := Fleet(block_size=16), tmp_path, 0.0)
    assert problems == [] and restored is not None and restored.events == 7
    assert fingerprint(fresh) == fingerprint(fleet_with(7))


def test_a_v1_snapshot_without_trailer_still_loads(tmp_path: Path) -> None:
    v2_image.write(fleet_with(7), tmp_path, 1.0)
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


# ----- content that passes the checksum but not the fleet (issue 22, item 6) ----------------------------

WORKER = WorkerInfo(77, 1, "llama", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "kv")


def newer_fleet() -> Fleet:
    """Unlike `fleet_with`: another model, a worker with endpoints, so a mix of two files shows."""
    fleet = Fleet(block_size=16)
    fleet.add_model("llama", block_size=32)
    fleet.register(WORKER)
    fleet.apply("llama", DUMP[:7], 0.0)
    return fleet


def fingerprint(fleet: Fleet) -> bytes:
    """Everything a snapshot of the fleet holds: two fleets with equal fingerprints restore alike."""
    return b"".join(v2_image.lines(snapshot.capture(fleet, 0.0)))


def two_snapshots(state_dir: Path) -> list[Any]:
    """The previous snapshot from `fleet_with(3)`, the newest from `newer_fleet()` (v2); the newest's lines parsed."""
    write(fleet_with(3), state_dir, 1.0)
    v2_image.write(newer_fleet(), state_dir, 2.0)
    return [json.loads(line) for line in (state_dir / snapshot.FILENAME).read_text().splitlines()[:-1]]


def rewrite(state_dir: Path, lines: list[Any]) -> None:
    """The newest snapshot holding `lines`, with a trailer that matches them: only the content is wrong."""
    encoded = (json.dumps(line).encode() + b"\n" for line in lines)
    (state_dir / snapshot.FILENAME).write_bytes(b"".join(v2_image.with_trailer(encoded)))


def falls_back_cleanly(state_dir: Path) -> str:
    """Restores the previous snapshot, exactly, and nothing of the newest; returns the problem found."""
    restored, problems = snapshot.restore(fresh := Fleet(block_size=16), state_dir, 0.0)
    is_the_previous_exactly(restored, problems, fresh)
    assert (state_dir / f"{snapshot.FILENAME}.damaged").exists()
    return problems[0]


def is_the_previous_exactly(restored: snapshot.Restored | None, problems: list[str], fresh: Fleet) -> None:
    assert restored is not None and restored.path.name == snapshot.PREVIOUS and len(problems) == 1
    assert fingerprint(fresh) == fingerprint(fleet_with(3))


@pytest.mark.parametrize(("where", "bad", "needle"), [
    (("models",), [], "models"),
    (("models", "llama"), "32", "$.models[...]"),
    (("workers", 0, "worker_id"), "abc", "worker_id"),
    (("workers", 0, "dp_rank"), 2**40, "dp_rank"),
    (("workers", 0, "endpoint"), "nowhere", "not an engine endpoint"),
    (("workers", 0, "model"), "gpt", "not among the models"),
    (("taken_at",), float("nan"), "taken_at"),
])
def test_a_header_the_fleet_cannot_take_falls_back(tmp_path: Path, where: tuple[Any, ...], bad: Any,
                                                   needle: str) -> None:
    lines = two_snapshots(tmp_path)
    rewrite(tmp_path, [replaced(lines[0], where, bad), *lines[1:]])
    problem = falls_back_cleanly(tmp_path)
    assert f"{snapshot.FILENAME}:1: bad header" in problem and needle in problem


@pytest.mark.parametrize(("where", "bad"), [(("model",), 5), (("model",), "gpt"), (("event", "worker_id"), "abc"),
                                            (("event", "event", "data"), {"stored": {}})])
def test_a_bad_line_after_good_ones_falls_back_without_a_merge(tmp_path: Path, where: tuple[Any, ...],
                                                               bad: Any) -> None:
    lines = two_snapshots(tmp_path)
    assert len(lines) > 3
    rewrite(tmp_path, [*lines[:-1], replaced(lines[-1], where, bad)])  # every line before it is good
    assert f"{snapshot.FILENAME}:{len(lines)}:" in falls_back_cleanly(tmp_path)


def test_no_sound_snapshot_at_all_starts_empty(tmp_path: Path) -> None:
    lines = two_snapshots(tmp_path)
    rewrite(tmp_path, [replaced(lines[0], ("models",), [])])
    previous = tmp_path / snapshot.PREVIOUS
    previous.write_bytes(previous.read_bytes()[:-40])
    restored, problems = snapshot.restore(fresh := Fleet(block_size=16), tmp_path, 0.0)
    assert restored is None and len(problems) == 2 and fingerprint(fresh) == fingerprint(Fleet(block_size=16))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_mutation_restores_exactly_or_falls_back_cleanly(data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        state_dir, alone = Path(tmp, "state"), Path(tmp, "alone")
        lines = two_snapshots(state_dir)
        n = data.draw(st.integers(0, len(lines) - 1), label="line")
        lines[n] = data.draw(mutated(lines[n], JSON_JUNK), label="mutated")
        rewrite(state_dir, lines)
        alone.mkdir()
        shutil.copy(state_dir / snapshot.FILENAME, alone / snapshot.FILENAME)
        restored, problems = snapshot.restore(fresh := Fleet(block_size=16), state_dir, 0.0)
        if restored is not None and restored.path.name == snapshot.FILENAME:
            assert problems == []  # taken as it is: the same as from that file alone, nothing of the previous
            snapshot.restore(by_itself := Fleet(block_size=16), alone, 0.0)
            assert fingerprint(fresh) == fingerprint(by_itself)
        else:
            is_the_previous_exactly(restored, problems, fresh)


def test_a_router_started_on_bad_content_serves_the_previous_snapshot_and_says_why(tmp_path: Path) -> None:
    lines = two_snapshots(tmp_path)
    rewrite(tmp_path, [replaced(lines[0], ("workers", 0, "worker_id"), "abc"), *lines[1:]])
    with serving(tmp_path, "--snapshot-interval", "3600") as (proc, client):
        restore = client.get("/v1/status").json()["restore"]
        assert restore["file"] == snapshot.PREVIOUS and restore["events"] == 3
        assert len(restore["problems"]) == 1 and "worker_id" in restore["problems"][0]
        assert client.get("/v1/workers").status_code == 200
        assert client.get("/v1/tree/stats").json()["models"]["default"]["blocks"] == blocks(fleet_with(3))
        log = _stop(proc)
    assert "damaged snapshot" in log and "restored 3 events from snapshot.jsonl.prev" in log


def test_a_v2_image_loads_in_slices_into_the_same_index_as_the_fleet_written(tmp_path: Path) -> None:
    fleet = fleet_with(len(DUMP))
    v2_image.write(fleet, tmp_path, 1.0)
    steps = snapshot.restore_in_slices(fresh := Fleet(block_size=16), tmp_path, 0.0)
    seen: list[snapshot.Progress] = []
    while True:
        try:
            seen.append(next(steps))
        except StopIteration as done:
            restored, problems = done.value
            break
    lines = len((tmp_path / snapshot.FILENAME).read_bytes().splitlines())
    assert [p.phase for p in seen] == ["reading the image"] * (lines - 2) + ["applying the image"] * (lines - 2)
    reading, applying = seen[: lines - 2], seen[lines - 2:]
    assert [p.done for p in reading] == sorted(p.done for p in reading) and reading[-1].done < reading[-1].total
    assert [p.done for p in applying] == list(range(1, lines - 1)) and applying[-1].total == lines - 2
    assert problems == [] and restored is not None and restored.events == lines - 2
    assert fresh.stats() == fleet.stats()
    assert sorted(map(repr, fresh.models["default"].router.index.capture())) == sorted(
        map(repr, fleet.models["default"].router.index.capture()))


def test_a_hash_past_u64_in_an_image_line_is_refused_naming_it(tmp_path: Path) -> None:
    v2_image.write(fleet_with(3), tmp_path, 1.0)
    path = tmp_path / snapshot.FILENAME
    lines = path.read_text().splitlines(keepends=True)
    line = json.loads(lines[1])
    line["event"]["event"]["data"]["stored"]["blocks"][0]["block_hash"] = 2**64
    lines[1] = json.dumps(line) + "\n"
    path.write_text("".join(lines[:-1]))
    header = json.loads(lines[0]) | {"schema": "kvctl.snapshot/v1"}  # no trailer: the line itself is read
    path.write_text(json.dumps(header) + "\n" + "".join(lines[1:-1]))
    restored, problems = snapshot.restore(Fleet(block_size=16), tmp_path, 0.0)
    assert restored is None and len(problems) == 1 and ":2: " in problems[0] and "block_hash" in problems[0]


def test_an_image_keeps_the_seqs_of_the_streams_registered_now(tmp_path: Path) -> None:
    """Each stream's seq is the image's when its worker is still registered on that endpoint; a worker now on
    another endpoint is another publisher, whose seqs start afresh."""
    fleet = Fleet()
    for n in (1, 2):
        endpoint = f"tcp://127.0.0.1:500{n}"
        fleet.register(WorkerInfo(n, 0, "default", endpoint))
        fleet.applied_seq(((n, 0), endpoint), 10 * n)
    fleet.register(WorkerInfo(2, 0, "default", "tcp://127.0.0.1:6002"))
    snapshot.write(snapshot.capture(fleet, 0.0), tmp_path)
    again = Fleet()
    snapshot.restore(again, tmp_path, 0.0)
    assert again.stream_seqs == {((1, 0), "tcp://127.0.0.1:5001"): 10}
