"""A mock engine end to end: HTTP in, real ZMQ events out, decoded by kvctl's own engine decoder."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import zmq
import zmq.asyncio

from kvctl.core.events import (
    END_SEQ,
    Cleared,
    EngineMessage,
    Removed,
    Stored,
    Tier,
    decode_engine_message,
    decode_replay_reply,
)
from kvctl.core.events.engine import encode_replay_request
from kvctl.core.hashing import local_block_hashes
from kvctl.mock.engine import SLOW_FACTOR, EngineConfig, Faults
from kvctl.mock.hashing import BlockHasher, HashStyle
from kvctl.mock.publisher import Publisher
from tests.mock.conftest import EngineFactory, SocketFactory, generate, subscribe
from tests.support import eventually_async

TOKENS = list(range(1000, 1010))  # two full blocks of 4 and a partial one


async def _recv(sub: zmq.asyncio.Socket, timeout: float = 2.0) -> EngineMessage:
    return decode_engine_message(await asyncio.wait_for(sub.recv_multipart(), timeout))


@pytest.mark.parametrize(("fmt", "style"), [("vllm", HashStyle.vllm), ("vllm-legacy", HashStyle.vllm),
                                            ("sglang", HashStyle.sglang)])
async def test_generate_publishes_the_stored_blocks(
    mock_engine: EngineFactory, zsock: SocketFactory, fmt: str, style: HashStyle
) -> None:
    async with mock_engine(format=fmt, dp_rank=2) as engine:
        sub = await subscribe(zsock, engine)
        lines = await generate(engine, TOKENS, max_tokens=3)
        message = await _recv(sub)
    assert [line["event"] for line in lines] == ["first_token", "done"]
    assert lines[0]["prompt_tokens"] == 10 and lines[0]["cached_tokens"] == 0 and lines[1]["output_tokens"] == 3
    assert (message.seq, message.batch.dp_rank, message.batch.errors) == (0, 2, [])
    [stored] = message.batch.events
    assert isinstance(stored, Stored) and stored.parent_hash is None and stored.tier is Tier.device
    engine_hashes = [h & (2**64 - 1) for h, _ in BlockHasher(style).chain(TOKENS, 4)]
    assert stored.block_hashes == engine_hashes
    assert stored.tokens_hashes == local_block_hashes(TOKENS[:8], 4)


async def test_a_repeated_prefix_is_a_hit_and_chains_under_its_parent(
    mock_engine: EngineFactory, zsock: SocketFactory
) -> None:
    async with mock_engine() as engine:
        sub = await subscribe(zsock, engine)
        await generate(engine, TOKENS[:8])
        first = (await _recv(sub)).batch.events[0]
        lines = await generate(engine, TOKENS[:8] + [7, 7, 7, 7])
        second = (await _recv(sub)).batch.events[0]
    assert lines[0]["cached_tokens"] == 8
    assert isinstance(first, Stored) and isinstance(second, Stored)
    assert second.parent_hash == first.block_hashes[-1] and len(second.block_hashes) == 1


async def test_eviction_publishes_removals(mock_engine: EngineFactory, zsock: SocketFactory) -> None:
    async with mock_engine(capacity=2) as engine:
        sub = await subscribe(zsock, engine)
        await generate(engine, TOKENS[:8])
        first = (await _recv(sub)).batch.events[0]
        await generate(engine, list(range(8)))
        events = (await _recv(sub)).batch.events
    assert isinstance(first, Stored)
    assert [e.block_hashes for e in events if isinstance(e, Removed)] == [[h] for h in reversed(first.block_hashes)]


async def test_drop_every_leaves_a_gap_that_replay_repairs(mock_engine: EngineFactory, zsock: SocketFactory) -> None:
    async with mock_engine(faults=Faults(drop_every=2)) as engine:
        sub = await subscribe(zsock, engine)
        for start in (0, 100, 200):
            await generate(engine, list(range(start, start + 4)))
        seqs = [(await _recv(sub)).seq for _ in range(2)]
        dealer = zsock(zmq.DEALER)
        dealer.connect(engine.info()["replay_endpoint"])
        await dealer.send_multipart(encode_replay_request(1))
        replies = [decode_replay_reply(await asyncio.wait_for(dealer.recv_multipart(), 2)) for _ in range(3)]
    assert seqs == [0, 2]
    assert [(r.seq, r.topic, r.end) for r in replies] == [(1, "", False), (2, "", False), (END_SEQ, "", True)]
    missing = decode_engine_message([b"", (1).to_bytes(8, "big"), replies[0].payload])
    assert isinstance(missing.batch.events[0], Stored)


async def test_legacy_replay_has_no_topic_frame(mock_engine: EngineFactory, zsock: SocketFactory) -> None:
    async with mock_engine(format="vllm-legacy") as engine:
        await generate(engine, TOKENS)
        dealer = zsock(zmq.DEALER)
        dealer.connect(engine.info()["replay_endpoint"])
        await dealer.send_multipart(encode_replay_request(0))
        frames = [await asyncio.wait_for(dealer.recv_multipart(), 2) for _ in range(2)]
    assert [len(f) for f in frames] == [3, 3]
    assert [decode_replay_reply(f).seq for f in frames] == [0, END_SEQ]


async def test_restart_after_resets_seq_and_cache_silently(mock_engine: EngineFactory, zsock: SocketFactory) -> None:
    async with mock_engine(faults=Faults(restart_after=0.5)) as engine:
        sub = await subscribe(zsock, engine)
        await generate(engine, TOKENS)
        await generate(engine, list(range(4)))
        assert [(await _recv(sub)).seq for _ in range(2)] == [0, 1]
        while not engine.restarts:
            await asyncio.sleep(0.05)
        first = await generate(engine, TOKENS)
        # The restarted engine binds a new PUB: what it sends before our SUB has reconnected is not seen
        # (the slow joiner), so publish until something arrives; its seq counts from 0 again.
        for published in range(1, 20):
            try:
                message = await _recv(sub, timeout=0.25)
                break
            except TimeoutError:
                await generate(engine, list(range(2000 + 10 * published, 2010 + 10 * published)))
        else:
            raise AssertionError("nothing arrived from the restarted engine")
    assert message.seq < published  # 0 unless the first publishes went out before the reconnect
    assert first[0]["cached_tokens"] == 0  # the cache went with the restart
    assert isinstance(message.batch.events[0], Stored)


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
async def test_clear_announces_all_blocks_cleared_in_sequence(
    mock_engine: EngineFactory, zsock: SocketFactory, fmt: str
) -> None:
    async with mock_engine(format=fmt) as engine, httpx.AsyncClient(base_url=engine.url) as client:
        sub = await subscribe(zsock, engine)
        await generate(engine, TOKENS)
        stored = await _recv(sub)
        response = await client.post("/v1/clear")
        cleared = await _recv(sub)
        lines = await generate(engine, TOKENS)
    assert response.json() == {"worker_id": 1, "clears": 1}
    assert (stored.seq, cleared.seq) == (0, 1)  # the stream goes on: no restart
    assert cleared.batch.events == [Cleared()] and cleared.batch.errors == []
    assert lines[0]["cached_tokens"] == 0 and engine.restarts == 0


async def test_silent_engine_serves_but_publishes_nothing(mock_engine: EngineFactory, zsock: SocketFactory) -> None:
    async with mock_engine(faults=Faults(silent=True)) as engine:
        sub = await subscribe(zsock, engine)
        lines = await generate(engine, TOKENS)
        with pytest.raises(TimeoutError):
            await _recv(sub, timeout=0.3)
    assert lines[-1]["event"] == "done"


async def test_nondeterministic_hash_and_fault_block_size(mock_engine: EngineFactory, zsock: SocketFactory) -> None:
    async with mock_engine(faults=Faults(nondeterministic_hash=True, block_size=2), seed=7) as engine:
        sub = await subscribe(zsock, engine)
        await generate(engine, TOKENS[:4])
        stored = (await _recv(sub)).batch.events[0]
    assert engine.info()["block_size"] == 2
    assert isinstance(stored, Stored) and len(stored.block_hashes) == 2
    assert set(stored.block_hashes).isdisjoint(h for h, _ in BlockHasher(HashStyle.vllm).chain(TOKENS[:4], 2))


async def test_metrics_use_vllm_names_and_kvbm_names_without_total(mock_engine: EngineFactory) -> None:
    async with mock_engine(capacity=1, host_capacity=2, disk_capacity=2) as engine:
        for tokens in (TOKENS[:4], list(range(4)), TOKENS[:4]):  # the third is onboarded from the host
            await generate(engine, tokens)
        async with httpx.AsyncClient(base_url=engine.url) as client:
            text = (await client.get("/metrics")).text
            health = (await client.get("/healthz")).json()
            info = (await client.get("/v1/info")).json()
    labels = '{engine="0",model_name="mock"}'
    for line in (f"vllm:kv_cache_usage_perc{labels} 0.0", f"vllm:num_requests_running{labels} 0.0",
                 f"vllm:num_requests_waiting{labels} 0.0", f"vllm:prefix_cache_queries_total{labels} 12.0",
                 f"vllm:prefix_cache_hits_total{labels} 0.0",
                 'vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="mock",source="host"} 4.0',
                 "kvbm_offload_blocks_d2h 2", "kvbm_onboard_blocks_h2d 1", "kvbm_matched_tokens 4",
                 "# TYPE kvbm_offload_blocks_d2h counter"):
        assert line in text.splitlines()
    assert "kvbm_host_cache_hit_rate 0.3333333333333333" in text
    assert "kvbm_" not in "".join(line for line in text.splitlines() if "_total" in line)
    assert health == {"status": "ok"}
    assert info == engine.info() and info["worker_id"] == 1


async def test_without_tiers_there_are_no_kvbm_metrics(mock_engine: EngineFactory) -> None:
    async with mock_engine() as engine, httpx.AsyncClient(base_url=engine.url) as client:
        text = (await client.get("/metrics")).text
    assert "vllm:kv_cache_usage_perc" in text and "kvbm_" not in text


async def test_full_queue_is_refused_and_slow_engines_queue(mock_engine: EngineFactory) -> None:
    async with mock_engine(max_running=1, max_waiting=1, speedup=4.0, faults=Faults(slow=True)) as engine:
        # a prefill of 10 tokens and 4 decode steps (2 of 64 blocks in use), each step 25 times slower: ~290 ms
        slow_ms = SLOW_FACTOR * (engine.timing.prefill_ms(10) + 4 * engine.timing.decode_step_ms(2 / 64))
        running = asyncio.ensure_future(generate(engine, TOKENS, max_tokens=5))
        queued = asyncio.ensure_future(generate(engine, TOKENS, max_tokens=1))
        while engine.waiting < 1:
            await asyncio.sleep(0.01)
        assert engine.running == 1
        async with httpx.AsyncClient(base_url=engine.url) as client:
            refused = await client.post("/v1/generate", json={"token_ids": TOKENS})
            bad = await client.post("/v1/generate", json={"token_ids": [-1]})
        first, second = await asyncio.gather(running, queued)
    assert refused.status_code == 503 and bad.status_code == 422
    assert first[-1]["total_ms"] >= 0.9 * slow_ms and second[0]["ttft_ms"] >= 0.9 * slow_ms


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="format"):
        EngineConfig(worker_id=1, format="trtllm")
    with pytest.raises(ValueError, match="positive"):
        EngineConfig(worker_id=1, capacity=0)


async def test_the_pub_counts_each_subscription_and_what_follows_one_is_delivered(zsock: SocketFactory) -> None:
    """`subscriptions()` is what tests wait on instead of sleeping for ZMQ's slow joiner: once it counts a
    SUB, the next batch reaches that SUB, seq 0 included."""
    publisher = Publisher()
    try:
        assert publisher.subscriptions() == 0
        subs = [zsock(zmq.SUB) for _ in range(2)]
        for sub in subs:
            sub.subscribe(b"")
            sub.connect(publisher.endpoint)
        await eventually_async(publisher.subscriptions, "both subscriptions", until=lambda n: n == 2)
        publisher.publish(b"payload")
        for sub in subs:
            assert await asyncio.wait_for(sub.recv_multipart(), 5) == [b"", (0).to_bytes(8, "big"), b"payload"]
    finally:
        await publisher.close()
