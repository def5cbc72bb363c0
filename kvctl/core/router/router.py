"""One model's routing decision end to end: hash the prompt, match it, price every candidate, pick.

Pure like the rest of the core: the caller passes the clock (`now`) and the random source, and
decides which workers are candidates and which are busy.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence

from kvctl.core.hashing import packed_block_hashes, sequence_hashes
from kvctl.core.index import KvIndex
from kvctl.core.names import Role, WorkerKey
from kvctl.core.router.approx import ApproxIndexer
from kvctl.core.router.scoring import Decision, RouterConfig, Scores, booked_prefill_tokens, decide, score
from kvctl.core.router.sequences import ActiveSequences
from kvctl.core.tracking_hash import TrackingKey


class Router:
    def __init__(self, *, block_size: int = 16, config: RouterConfig | None = None, index: KvIndex | None = None,
                 sequences: ActiveSequences | None = None, rng: random.Random | None = None,
                 approx: ApproxIndexer | None = None, tracking: TrackingKey | None = None,
                 tracking_model: str = "") -> None:
        """With `approx` (no KV events), the router's own decisions are what the index learns from. With
        `tracking` (Dynamo's keyed-xxh3-v1), in-flight requests are tracked by keyed sequence hashes, in the scope
        of `tracking_model`: the model name the frontend hashes under (its model card's)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.config = config or RouterConfig()
        if approx is not None and index is not None:
            raise ValueError("an approximate-mode router indexes its own decisions: give approx or index")
        self.approx = approx
        self.index = approx.index if approx is not None else (index if index is not None else KvIndex())
        self.sequences = sequences if sequences is not None else ActiveSequences()
        self.rng = rng or random.Random()
        self._fresh = random.Random()  # the decode pool's booked blocks: apart from `rng`, which draws ties
        self.tracking = tracking
        self.tracking_model = tracking_model
        self.eagle = False
        """Hash prompts as EAGLE workers store blocks (B + 1 tokens each), as Dynamo's router does for a model whose
        cards say `enable_eagle`."""

    def route(
        self,
        candidates: Sequence[WorkerKey],
        *,
        token_ids: Sequence[int] | None = None,
        local_hashes: Sequence[int] | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        request_id: str | None = None,
        reserve: bool = False,
        overrides: Mapping[str, float | bool | None] | None = None,
        busy: Mapping[WorkerKey, bool] | None = None,
        now: float = 0.0,
        role: Role = Role.aggregated,
    ) -> Decision:
        """Choose a worker for a prompt given as token ids or as Dynamo local hashes (then ISL = blocks x B).

        With `reserve`, the request is tracked as in flight on the chosen worker until it is freed. `overrides`
        are this request's own knobs (`RouterConfig.override`: Dynamo names or the legacy aliases); BadKnob
        when one is out of range. `role`: the pool the candidates form, priced as `RouterConfig.for_pool`.
        `lora_name` and `cache_salt` are hashed into the prompt's blocks as Dynamo does (`hashing.block_seed`).
        """
        b = self.block_size
        if token_ids is not None:
            local: Sequence[int] = packed_block_hashes(token_ids, b, lora_name=lora_name, cache_salt=cache_salt,
                                                       eagle=self.eagle)
            isl = len(token_ids)
        elif local_hashes is not None:
            local = list(local_hashes)
            isl = len(local) * b
        else:
            raise ValueError("give token_ids or local_hashes")
        config = (self.config.override(**overrides) if overrides else self.config).for_pool(role)
        scores, seq, booked = self._score(candidates, local, len(local), isl,
                                          lambda: self._tracked(token_ids, local, lora_name), config, busy, reserve)
        decision = decide(scores, isl_tokens=isl, block_size=b, temperature=config.router_temperature, rng=self.rng,
                          role=role)
        if reserve:
            if request_id is None:
                raise ValueError("reserve needs a request_id")
            prefill = booked_prefill_tokens(isl, decision.effective_overlap, b, config)
            self.sequences.add(request_id, decision.worker, booked, prefill, now, decision.overlap_blocks)
            if self.approx is not None:  # the index's own hashes: public, whatever in-flight requests are tracked by
                self.approx.record(decision.worker, local, seq if self.tracking is None else sequence_hashes(local),
                                   now, request_id=request_id, private=int(isl > len(local) * b))
        return decision

    def assess(self, candidates: Sequence[WorkerKey], local_hashes: Sequence[int], sequence_hashes: Sequence[int],
               *, isl_tokens: int, busy: Mapping[WorkerKey, bool] | None = None, role: Role = Role.aggregated
               ) -> Scores:
        """Every candidate's cost for a prompt another router routed, as this one would price it now, deciding
        nothing: `sequence_hashes` are the prompt's in-flight hashes as that router published them (its replica
        sync's), `local_hashes` those of the prefix the index holds (`KvIndex.path_of_sequence`)."""
        return self._score(candidates, local_hashes, len(sequence_hashes), isl_tokens, lambda: sequence_hashes,
                           self.config.for_pool(role), busy, False)[0]

    def _score(self, candidates: Sequence[WorkerKey], local: Sequence[int], n_blocks: int, isl: int,
               tracked: Callable[[], Sequence[int]], config: RouterConfig, busy: Mapping[WorkerKey, bool] | None,
               reserve: bool) -> tuple[Scores, Sequence[int], Sequence[int]]:
        """The candidates' scores, the prompt's tracked hashes and the hashes a reservation would book; `local`:
        the prompt's local hashes, or the prefix of them the index holds, of a prompt of `n_blocks` full blocks."""
        matches = self.index.find_matches(local)  # the approx indexer's own index in approximate mode
        sequences = self.sequences
        loads = sequences.loads()
        # Sequence hashes matter only against in-flight blocks, or to reserve: skip them otherwise.
        seq = tracked() if loads or reserve else local
        new_blocks: Callable[[WorkerKey], int] | int
        booked: Sequence[int]  # the block hashes a reservation books
        if not config.track_active_blocks:
            new_blocks, booked = 0, ()
        elif not config.assume_kv_reuse:  # blocks of its own, as Dynamo books them: fresh random hashes
            new_blocks, booked = n_blocks, [self._fresh.getrandbits(64) for _ in range(n_blocks)] if reserve else ()
        else:
            new_blocks, booked = (lambda w: sequences.new_prompt_blocks(w, seq)) if loads else n_blocks, seq
        scores = score(candidates, matches, loads, new_blocks, isl_tokens=isl, block_size=self.block_size,
                       config=config, busy=busy)
        return scores, seq, booked

    def _tracked(self, token_ids: Sequence[int] | None, local: Sequence[int], lora_name: str | None) -> Sequence[int]:
        """The hashes a request's blocks are tracked by in flight: its sequence hashes, keyed where Dynamo's are."""
        if self.tracking is None:
            return sequence_hashes(local)
        if token_ids is None:
            raise ValueError("keyed tracking hashes need the prompt's token_ids: local_hashes do not carry them")
        return self.tracking.sequence_hashes(token_ids, self.tracking_model, self.block_size, lora_name=lora_name)

    def tick(self, now: float) -> tuple[list[str], int]:
        """Time-driven housekeeping: force-free stale requests, expire approximate-mode blocks."""
        freed = self.sequences.expire(now)
        if self.approx is None:
            return freed, 0
        return freed, self.approx.expire(now) + sum(self.approx.release(request_id) for request_id in freed)

    def free(self, request_id: str) -> bool:
        """A booked request done: no longer in flight; under approximate LRU its blocks released."""
        if self.approx is not None:
            self.approx.release(request_id)
        return self.sequences.free(request_id)
