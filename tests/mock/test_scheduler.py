"""A mock engine's step scheduler through real engines over HTTP: the engine's time is shared as a GPU's is.

Expected times come from the engine's own timing model; the bounds are ratios with room for a loaded machine.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvctl.mock.scheduler import StepScheduler
from kvctl.mock.timing import TimingModel
from tests.mock.conftest import EngineFactory, generate, metric
from tests.support import eventually_async

ROOMY = {"block_size": 16, "capacity": 4096, "speedup": 1.0}
"""Real-time model, and a cache so large that KV usage (and so the decode step) stays near its minimum."""
OUT = 40


def cold(k: int, tokens: int) -> list[int]:
    """A prompt that shares no block with any other `k`."""
    return [k * 100_000 + t for t in range(tokens)]


def decode_ms(lines: list[dict]) -> float:
    return float(lines[-1]["total_ms"] - lines[0]["ttft_ms"])


async def test_a_warm_request_has_a_clearly_lower_ttft_than_a_cold_one(mock_engine: EngineFactory) -> None:
    async with mock_engine(**{**ROOMY, "speedup": 0.5}) as engine:  # times long enough to dwarf a loaded loop's lag
        prompt = cold(1, 2176)
        first = await generate(engine, prompt, max_tokens=1)
        warm = await generate(engine, prompt[:-16] + cold(2, 16), max_tokens=1)  # all cached but the last block
    assert (first[0]["cached_tokens"], warm[0]["cached_tokens"]) == (0, 2160)
    assert first[0]["ttft_ms"] >= 0.9 * engine.timing.prefill_ms(2176)  # 103 ms
    assert warm[0]["ttft_ms"] < 0.6 * first[0]["ttft_ms"]  # 16 new tokens: 33.5 ms


async def test_cold_prefills_queue_on_one_engine_while_decodes_share_its_steps(mock_engine: EngineFactory) -> None:
    n = 4
    async with mock_engine(**ROOMY) as engine:
        alone = await generate(engine, cold(0, 1024), max_tokens=OUT)
        together = await asyncio.gather(*(generate(engine, cold(k, 1024), max_tokens=OUT) for k in range(1, n + 1)))
    last_ttft = max(lines[0]["ttft_ms"] for lines in together)
    assert last_ttft >= 0.8 * n * engine.timing.prefill_ms(1024)  # the engine computes the prefills in turn
    # ... but decodes everyone in each step: 39 steps, plus at most the others' prefills, not n times 39 steps
    assert max(decode_ms(lines) for lines in together) < 2 * decode_ms(alone)


async def test_a_prompt_over_the_token_budget_is_prefilled_in_chunks(mock_engine: EngineFactory) -> None:
    async with mock_engine(**ROOMY, max_batched_tokens=256) as engine, \
            httpx.AsyncClient(base_url=engine.url) as client:
        lines = await generate(engine, cold(0, 768), max_tokens=1)
        text = (await client.get("/metrics")).text
    assert metric(text, "vllm:iteration_tokens_total_count") == 3  # 3 steps of 256 tokens
    assert metric(text, "vllm:iteration_tokens_total_sum") == 768
    assert 'vllm:iteration_tokens_total_bucket{engine="0",le="256.0",model_name="mock"} 3.0' in text
    assert lines[0]["ttft_ms"] >= 0.9 * 3 * engine.timing.prefill_ms(256)  # 61 ms, against 28 ms in one step


async def test_a_client_gone_mid_prefill_frees_its_slot_and_its_blocks(mock_engine: EngineFactory) -> None:
    async with mock_engine(**{**ROOMY, "speedup": 0.1}, max_running=1) as engine:
        prefill_s = engine.timing.prefill_ms(2176) / 1e3  # 0.5 s

        async def read_all() -> None:
            async with httpx.AsyncClient(base_url=engine.url) as client, \
                    client.stream("POST", "/v1/generate", json={"token_ids": cold(1, 2176)}) as response:
                async for _ in response.aiter_lines():
                    pass

        reading = asyncio.create_task(read_all())
        await eventually_async(lambda: engine.running == 1, "the request running")
        gone = asyncio.get_running_loop().time()
        reading.cancel()
        await eventually_async(lambda: engine.running == 0 and engine.cache.used_blocks == 0,
                               "the slot and blocks freed")
        freed_s = asyncio.get_running_loop().time() - gone
        after = await generate(engine, cold(2, 16), max_tokens=1)
    assert freed_s < prefill_s / 2
    assert after[-1]["event"] == "done"


async def test_the_step_loop_runs_only_while_there_is_work(mock_engine: EngineFactory) -> None:
    async with mock_engine() as engine:
        assert not engine.scheduler.stepping
        await generate(engine, cold(0, 16))
        assert not engine.scheduler.stepping  # the last step finished the request, and the loop with it


async def test_closing_an_engine_does_not_wait_for_its_step_to_end(mock_engine: EngineFactory) -> None:
    async with mock_engine(**{**ROOMY, "speedup": 0.01}) as engine:  # a 5 s step
        pending = asyncio.create_task(generate(engine, cold(1, 2176), max_tokens=1))
        await eventually_async(lambda: engine.running == 1, "the request running")
        assert engine.scheduler.stepping
        closing = asyncio.get_running_loop().time()
    closed_s = asyncio.get_running_loop().time() - closing
    await asyncio.gather(pending, return_exceptions=True)  # its connection was closed under it
    assert closed_s < 3 and not engine.scheduler.stepping


async def test_a_request_whose_admission_fails_fails_alone() -> None:
    """An admission that raises (the cache or the publisher) fails that request, not the engine's step loop."""
    scheduler = StepScheduler(TimingModel(speedup=1000), max_running=4, max_batched_tokens=64,
                              kv_usage=lambda: 0.0, stepped=lambda tokens: None)
    released: list[str] = []

    def broken() -> int:
        raise RuntimeError("no cache")

    bad = scheduler.submit(1, broken, lambda: released.append("bad"))
    good = scheduler.submit(2, lambda: 8, lambda: released.append("good"))
    with pytest.raises(RuntimeError, match="no cache"):
        await asyncio.wait_for(bad.until(bad.first_token), 5)
    await asyncio.wait_for(good.until(good.finished), 5)
    assert released == ["good"] and not scheduler.stepping
