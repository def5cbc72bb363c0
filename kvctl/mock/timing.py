"""How long a mock engine's forward pass takes: Dynamo's mocker, polynomial perf model.

A prefix-cache hit is worth what it is worth on a GPU only if time depends on the tokens actually computed, and
a batch shares the GPU. So time is per forward pass (a scheduler step), as Dynamo's mocker models it: a prefill
costs a quadratic in the new (uncached) tokens it computes, fitted on a real GPU, and one decode step (one token for
every running request at once) costs a quadratic in the share of KV blocks in use. Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFILL_MS_CONSTANT = 1.650142e01
PREFILL_MS_PER_TOKEN = 1.518344e-02
PREFILL_MS_PER_TOKEN_SQUARED = 4.209989e-07
"""Prefill of n new tokens: CONSTANT + PER_TOKEN·n + PER_TOKEN_SQUARED·n² ms (Dynamo's mocker)."""

DECODE_MS_CONSTANT = 5.74
DECODE_MS_PER_USAGE = 54.01
DECODE_MS_PER_USAGE_SQUARED = -25.74
DECODE_MS_FLOOR = 1.0
"""One decode step at KV usage u in [0, 1]: CONSTANT + PER_USAGE·u + PER_USAGE_SQUARED·u² ms, at least FLOOR."""


@dataclass(frozen=True, slots=True)
class TimingModel:
    """Dynamo's mocker, polynomial perf model: milliseconds of GPU time per prefill and per decode step."""

    speedup: float = 1.0
    """Every time is divided by it (Dynamo's `--speedup-ratio`): tests and demos run the same model faster."""

    def __post_init__(self) -> None:
        if not self.speedup > 0:
            raise ValueError(f"the speedup must be positive, got {self.speedup}")

    def prefill_ms(self, new_tokens: int) -> float:
        """One request's prefill of `new_tokens` uncached tokens (0 when everything was cached)."""
        if new_tokens <= 0:
            return 0.0
        n = float(new_tokens)
        return (PREFILL_MS_CONSTANT + PREFILL_MS_PER_TOKEN * n + PREFILL_MS_PER_TOKEN_SQUARED * n * n) / self.speedup

    def decode_step_ms(self, kv_usage: float) -> float:
        """One decode step, every running request gaining a token, at `kv_usage` = active / total KV blocks."""
        u = min(max(kv_usage, 0.0), 1.0)
        ms = DECODE_MS_CONSTANT + DECODE_MS_PER_USAGE * u + DECODE_MS_PER_USAGE_SQUARED * u * u
        return max(DECODE_MS_FLOOR, ms) / self.speedup

    def describe(self) -> str:
        """The model and its terms in one line, for the output that shows timings."""
        squared = f"{PREFILL_MS_PER_TOKEN_SQUARED:.1e}".replace("e-0", "e-")
        return (f"Dynamo mocker polynomial: prefill {PREFILL_MS_CONSTANT:.1f} + {PREFILL_MS_PER_TOKEN:.3g}·n + "
                f"{squared}·n² ms per prefill of n uncached tokens, decode step {DECODE_MS_CONSTANT:.2f} + "
                f"{DECODE_MS_PER_USAGE:.1f}·u − {-DECODE_MS_PER_USAGE_SQUARED:.1f}·u² ms at KV usage u, "
                f"÷ speedup {self.speedup:g}")
