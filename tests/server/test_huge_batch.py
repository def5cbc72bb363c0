"""One engine message of 100,000 events held the router's loop for 0.57 s (issue 36): its model's writer now applies
a batch that large a slice of the loop at a time, as bulk loads are. Shown with a probe that runs whenever the loop
does and reads how much of the batch is in, not with a timer; and the batch stays whole in every order: a change to
its worker that comes while it is half applied (a reset, the worker's removal, a bulk load) finds all of it in."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from kvctl.core.events import EventData, Removed, RouterEvent, Stored, Tier
from kvctl.core.names import SeqMark
from kvctl.server.ingest.streams import SLICE_EVENTS, ModelWriter
from kvctl.server.state import Fleet

EVENTS = 100_000
WORKER = (1, 0)
MARK: SeqMark = ((WORKER, "tcp://engine:5557"), 41)


def chain(events: int) -> list[EventData]:
    """A batch of stored blocks in a chain, each the child of the one before."""
    return [Stored(i or None, [i + 1], [i + 1]) for i in range(events)]


def blocks(fleet: Fleet) -> int:
    return fleet.model("default").router.index.stats()[Tier.device].workers.get(WORKER, 0)


async def apply_while_probing(fleet: Fleet, events: int, at_half: Callable[[], None] | None = None) -> list[int]:
    """Queue a batch of `events` and wait for it, a probe reading the stored-event count each time the loop runs;
    `at_half` is called by the probe the first time it finds the batch half applied or more."""
    writer = ModelWriter(fleet, "default")
    counts = fleet.model("default").applied
    seen: list[int] = []

    async def probe() -> None:
        nonlocal at_half
        while True:
            await asyncio.sleep(0)
            seen.append(counts[("stored", "ok")])
            if 0 < seen[-1] < events:
                assert MARK[0] not in fleet.stream_seqs, "the seq is told with the batch's last events"
                if at_half is not None and seen[-1] >= events // 2:
                    at_half()
                    at_half = None

    probing = asyncio.get_running_loop().create_task(probe())
    writer.put(WORKER, chain(events), MARK)
    await writer.applied()
    probing.cancel()
    writer.task.cancel()
    assert not probing.done() or probing.cancelled(), probing.exception()
    return seen


async def test_a_100k_event_batch_is_applied_in_slices_with_the_loop_running_between() -> None:
    fleet = Fleet()
    seen = await apply_while_probing(fleet, EVENTS)
    halfway = sorted({n for n in seen if 0 < n < EVENTS})
    assert len(halfway) >= EVENTS // SLICE_EVENTS // 20, f"the loop ran {len(halfway)} times within the batch"
    assert all(n % SLICE_EVENTS == 0 for n in halfway)  # between slices, never inside one
    whole = Fleet()
    whole.apply_engine_batch("default", WORKER, chain(EVENTS), 0.0, MARK)
    assert fleet.model("default").router.index.dump() == whole.model("default").router.index.dump()
    assert fleet.stream_seqs == whole.stream_seqs == {MARK[0]: MARK[1]}


@pytest.mark.parametrize("change", ["reset", "unregister", "bulk load"])
async def test_a_change_to_the_worker_midway_finds_the_whole_batch_in(change: str) -> None:
    """What comes while the batch is half in applies after all of it, as if the batch had been one step."""
    fleet, events = Fleet(), 40 * SLICE_EVENTS
    changes = {
        "reset": lambda: fleet.reset("default", *WORKER),
        "unregister": lambda: fleet.unregister(*WORKER),
        "bulk load": lambda: fleet.apply("default", [RouterEvent(WORKER[0], Removed([events]), WORKER[1])], 0.0),
    }
    seen = await apply_while_probing(fleet, events, changes[change])
    assert any(events // 2 <= n < events for n in seen), "never found the batch half applied"
    assert fleet.model("default").applied[("stored", "ok")] == events
    assert blocks(fleet) == {"reset": 0, "unregister": 0, "bulk load": events - 1}[change]
    assert (WORKER in fleet.workers) is (change != "unregister")


def test_the_decode_process_sends_a_large_batch_in_parts_read_as_they_come() -> None:
    """The router reads its decode process's pipe 64 KiB a wake-up; a batch read whole held its loop for as long as
    making all its events took (~0.2 s at 100,000). In parts, a wake-up makes a few thousand at most."""
    from kvctl.core.events.engine_encode import VLLM, BlockStored, encode_batch
    from kvctl.server.ingest.decode_process.wire import PART_EVENTS, decode_now, live_answer, split_answers

    events = 20 * PART_EVENTS
    payload = encode_batch(VLLM, 0.0, [BlockStored([i + 1], i or None, list(range(16)), 16) for i in range(events)])
    wire, _ = live_answer(1, [b"", (5).to_bytes(8, "big"), payload], 16, False, False)
    buf, held, answers, most = bytearray(), [], [], 0
    for at in range(0, len(wire), 64 * 1024):
        before = len(held)
        buf += wire[at:at + 64 * 1024]
        answers += split_answers(buf, held)
        most = max(most, (len(answers[0][3].events) if answers else len(held)) - before)
    (answer,) = answers
    assert answer[:2] == (1, 5) and answer[3] == decode_now(payload, 16) and not held
    assert most <= 4 * PART_EVENTS, f"{most} events made in one read"


async def test_a_large_event_plane_batch_is_decoded_in_slices_as_in_one_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo's plane: a `kv-events` message of many events (100,000 took 1.2 s to decode in one step) is decoded
    and handed on a slice of the loop at a time; its events, and what is bad in it, are what one step finds."""
    from collections import Counter
    from types import SimpleNamespace

    from kvctl.server import budget

    # The slices' clock ticks a third of a slice per look: where the loop runs depends on the steps taken,
    # never on how fast this machine decodes.
    ticks = iter(range(1 << 62))
    monkeypatch.setattr(budget, "time", SimpleNamespace(perf_counter=lambda: next(ticks) * budget.SLICE_S / 3))

    import msgspec

    from kvctl.core.events.dynamo import (
        EventEnvelope,
        decode_router_event_batch,
        encode_envelope,
        encode_router_event_batch,
    )
    from kvctl.server.plane.ingest import PlaneIngest

    events = 5000  # under the writer's queue: putting them never waits
    good = [RouterEvent(1, Stored(i or None, [i + 1], [i + 1]), 0, i) for i in range(events)]
    items = msgspec.msgpack.decode(encode_router_event_batch(good))
    items[700] = {"worker_id": "one"}  # a bad event costs itself
    payload = msgspec.msgpack.encode(items)
    fleet = Fleet()
    writer = ModelWriter(fleet, "default")
    ingest = PlaneIngest(fleet, writer, model="default", router_id=9, replica_sync=False)
    runs = 0

    async def probe() -> None:
        nonlocal runs
        while True:
            await asyncio.sleep(0)
            runs += 1

    probing = asyncio.get_running_loop().create_task(probe())
    await asyncio.sleep(0)
    before = runs
    await ingest.receive("backend", "generate", "kv-events", encode_envelope(
        EventEnvelope(5, 0, 0, "kv-events", payload)))
    during = runs - before
    probing.cancel()
    await writer.applied()
    writer.task.cancel()
    assert during >= events // SLICE_EVENTS // 4, f"the loop ran {during} times while the message was taken in"
    decoded, bad = decode_router_event_batch(payload)
    assert ingest.errors == Counter(e.kind.value for e in bad) and len(bad) == 1
    assert ingest.counts["events"] == len(decoded) == events - 1
    assert blocks(fleet) == 700  # the chain breaks where the bad event was: as one step leaves it
