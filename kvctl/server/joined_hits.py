"""What a worker's engine found cached, joined with what the router predicted for the same requests: the check
that the index sees the caches it routes on (`prefill_complete`'s `cached_tokens`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvctl.core.router.sequences import ActiveRequest


@dataclass
class JoinedHits:
    """A worker's requests whose engine reported its cached tokens (`prefill_complete`'s `cached_tokens`), with
    what the router predicted for the same requests: both in prompt blocks, so predicted and observed hit rates
    are Σ cached / Σ prompt blocks over the same requests, and their difference is the disagreement itself."""

    requests: int = 0
    prompt_blocks: int = 0
    predicted_blocks: int = 0
    observed_blocks: int = 0

    def add(self, request: ActiveRequest, cached_tokens: int, block_size: int) -> None:
        prompt = len(request.block_hashes)
        self.requests += 1
        self.prompt_blocks += prompt
        self.predicted_blocks += min(request.overlap_blocks, prompt)
        self.observed_blocks += min(cached_tokens // block_size, prompt)
