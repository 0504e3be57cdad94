"""What the serving layer reads about one engine: its totals since start, and a snapshot of its state.

``LLMEngine`` keeps an ``EngineTotals``, folding in every step's
``IterationStats``; ``EngineStats`` joins those totals with the scheduler's
``SchedulerStats`` and the KV pool's block counts. ``AsyncLLM.get_stats()``
returns the snapshot its front-end thread published last; ``deployments/llm_server.py``
serves it as JSON.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.metrics.stats import IterationStats
from engine.sched.kv_transfer import KVTransferStats
from engine.sched.scheduler import SchedulerStats
from engine.sched.spec_decode_stats import SpecDecodingStats


@dataclass
class EngineTotals:
    """Counts since the engine started. A request is a user request: one with ``n`` > 1 counts once."""

    num_prompt_tokens: int = 0  # every added request's prompt, counted once when it is added
    # Counted as the core returns them, so every token counts once, whatever the output kind (CUMULATIVE
    # and FINAL_ONLY outputs repeat earlier tokens) and however many tokens an output carries.
    num_generation_tokens: int = 0
    num_finished_reqs: int = 0
    num_aborted_reqs: int = 0  # aborted while still in the engine (unknown or finished ids do not count)
    num_steps: int = 0

    def record_step(self, iteration_stats: IterationStats) -> None:
        """One ``LLMEngine.step()`` that returned."""
        self.num_steps += 1
        self.num_generation_tokens += iteration_stats.num_generation_tokens
        self.num_finished_reqs += iteration_stats.num_finished_reqs


@dataclass(frozen=True)
class SpecDecodingSummary:
    """Speculative decoding since start: the scheduler's ``SpecDecodingStats`` counts and the two figures
    made of them (``acceptance_rate``: accepted / draft tokens, 0 before any draft;
    ``mean_acceptance_length``: tokens per verified draft step, 1 + accepted / drafts, 1 before any)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: tuple[int, ...]  # [i]: drafts whose token i was accepted
    acceptance_rate: float
    mean_acceptance_length: float

    @classmethod
    def of(cls, stats: SpecDecodingStats) -> SpecDecodingSummary:
        return cls(
            num_drafts=stats.num_drafts,
            num_draft_tokens=stats.num_draft_tokens,
            num_accepted_tokens=stats.num_accepted_tokens,
            num_accepted_tokens_per_pos=tuple(stats.num_accepted_tokens_per_pos),
            acceptance_rate=stats.acceptance_rate,
            mean_acceptance_length=stats.mean_acceptance_length,
        )


@dataclass(frozen=True)
class EngineStats:
    """A snapshot the front end publishes after every step (``*_total`` count since start).

    Blocks exclude the null block; ``num_free_blocks`` counts blocks that only
    hold a cached prefix as free (they are evicted on demand). The prefix-cache
    counters are in tokens.
    """

    num_running_reqs: int
    num_waiting_reqs: int
    num_total_blocks: int
    num_free_blocks: int
    kv_cache_usage: float
    num_generated_tokens_total: int
    num_prompt_tokens_total: int
    num_finished_reqs_total: int
    num_aborted_reqs_total: int
    num_preemptions_total: int
    num_steps_total: int
    prefix_cache_hits: int
    prefix_cache_queries: int
    kv_transfer: KVTransferStats | None = None  # disaggregated prefill only (a copy)
    spec_decoding: SpecDecodingSummary | None = None  # with speculative decoding configured

    @classmethod
    def derive(
        cls, scheduler_stats: SchedulerStats, totals: EngineTotals, num_total_blocks: int, num_free_blocks: int
    ) -> EngineStats:
        """The snapshot of these stats; it shares nothing mutable with them (the engine steps on)."""
        prefix = scheduler_stats.prefix_cache_stats
        kv_transfer = scheduler_stats.kv_transfer_stats
        spec_decoding = scheduler_stats.spec_decoding_stats
        return cls(
            num_running_reqs=scheduler_stats.num_running_reqs,
            num_waiting_reqs=scheduler_stats.num_waiting_reqs,
            num_total_blocks=num_total_blocks,
            num_free_blocks=num_free_blocks,
            kv_cache_usage=scheduler_stats.kv_cache_usage,
            num_generated_tokens_total=totals.num_generation_tokens,
            num_prompt_tokens_total=totals.num_prompt_tokens,
            num_finished_reqs_total=totals.num_finished_reqs,
            num_aborted_reqs_total=totals.num_aborted_reqs,
            num_preemptions_total=scheduler_stats.num_preemptions,
            num_steps_total=totals.num_steps,
            prefix_cache_hits=prefix.num_hit_tokens,
            prefix_cache_queries=prefix.num_queried_tokens,
            kv_transfer=None if kv_transfer is None else dataclasses.replace(kv_transfer),
            spec_decoding=None if spec_decoding is None else SpecDecodingSummary.of(spec_decoding),
        )
