"""The ZMQ tap judges an engine's seqs by the router's own rules (`Sequence`), against a real PUB socket."""

from __future__ import annotations

import threading

import zmq

from kvctl.core.events.engine import decode_engine_batch
from kvctl.event_taps import TapStats, tap_zmq
from tests.fixtures_path import FIXTURES

PAYLOAD = (FIXTURES / "vllm-0.33" / "a_block_stored_4x16.msgpack").read_bytes()


def test_the_zmq_tap_counts_a_jump_and_restarts_and_shows_a_gap() -> None:
    """Before, a seq of 2^64 - 1 became the tap's place, and a restart (the same seq again, or a lower one)
    went unnoticed."""
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    stats, tapped, done = TapStats(), [], threading.Event()
    seqs = [0, 1, 1, 2**64 - 1, 2, 5, 0]
    per_batch = len(decode_engine_batch(PAYLOAD, default_block_size=16).events)

    def tap() -> None:
        tapped.extend(tap_zmq(f"tcp://127.0.0.1:{port}", stop=lambda: stats.messages == len(seqs), stats=stats,
                              block_size=16))
        done.set()

    thread = threading.Thread(target=tap, daemon=True)
    thread.start()
    try:
        assert pub.poll(10_000), "the tap never subscribed"
        pub.recv()
        for seq in seqs:
            pub.send_multipart([b"", seq.to_bytes(8, "big"), PAYLOAD])
        assert done.wait(10), stats
    finally:
        pub.close(0)
    gaps = [t.missing for t in tapped if t.event is None]
    assert gaps == [(3, 4)]
    assert [t.seq for t in tapped if t.event is not None][::per_batch] == seqs
    assert stats.as_dict() == {"messages": 7, "events": 7 * per_batch, "gaps": 1, "missing": 2, "restarts": 2,
                               "repeats": 0, "jumps": 1, "decode_errors": {}}
