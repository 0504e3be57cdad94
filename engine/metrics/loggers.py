"""Stat loggers: where each step's ``SchedulerStats`` and ``IterationStats`` go.

The async front end calls every logger's ``record`` on its front-end thread
after each step, and ``log`` from time to time; loggers must be cheap in
``record``. The serving layer adds one that exports Prometheus metrics
through Ray; ``LoggingStatLogger`` is vLLM's periodic throughput line.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from engine.metrics.stats import IterationStats
from engine.sched.scheduler import SchedulerStats
from engine.sched.spec_decode_stats import SpecDecodingStats

logger = logging.getLogger("engine.metrics")


class StatLogger(Protocol):
    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        """One step's statistics (on the serving event loop; must not block)."""

    def log(self) -> None:
        """Called about every ``log_interval_s``; loggers that aggregate print here."""


class LoggingStatLogger:
    """Logs prompt and generation throughput, queue sizes and cache use, like vLLM's engine log line; with
    speculative decoding, vLLM's "SpecDecoding metrics" line too (``SpecDecodingLogging``)."""

    def __init__(self, model_name: str = "") -> None:
        self.prefix = f"[{model_name}] " if model_name else ""
        self._reset(time.monotonic())
        self.last_scheduler_stats: SchedulerStats | None = None
        self.spec_decoding = SpecDecodingLogging(self.prefix)

    def _reset(self, now: float) -> None:
        self.last_log_time = now
        self.num_prompt_tokens = self.num_generation_tokens = 0

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self.num_prompt_tokens += iteration_stats.num_prompt_tokens
        self.num_generation_tokens += iteration_stats.num_generation_tokens
        self.last_scheduler_stats = scheduler_stats

    def log(self) -> None:
        now = time.monotonic()
        elapsed = max(now - self.last_log_time, 1e-9)
        stats = self.last_scheduler_stats
        if stats is not None and (self.num_prompt_tokens or self.num_generation_tokens or stats.num_running_reqs):
            hit_rate = stats.prefix_cache_stats.hit_rate  # since start
            logger.info(
                "%sAvg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                self.prefix,
                self.num_prompt_tokens / elapsed,
                self.num_generation_tokens / elapsed,
                stats.num_running_reqs,
                stats.num_waiting_reqs,
                100 * stats.kv_cache_usage,
                100 * hit_rate,
            )
        if stats is not None and stats.spec_decoding_stats is not None:
            self.spec_decoding.log(stats.spec_decoding_stats, elapsed)
        self._reset(now)


class SpecDecodingLogging:
    """vLLM's "SpecDecoding metrics" line over one logging interval: the difference between the
    scheduler's totals now and at the previous line. Nothing is logged for an interval without drafts."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self.last = SpecDecodingStats(num_spec_tokens=0)  # the totals at the previous line

    def log(self, totals: SpecDecodingStats, elapsed_s: float) -> None:
        """``totals``: the scheduler's counts since start; ``elapsed_s``: the interval's length."""
        last, self.last = self.last, totals.copy()
        num_drafts = totals.num_drafts - last.num_drafts
        if num_drafts <= 0:
            return
        num_draft_tokens = totals.num_draft_tokens - last.num_draft_tokens
        num_accepted = totals.num_accepted_tokens - last.num_accepted_tokens
        last_per_pos = last.num_accepted_tokens_per_pos + [0] * len(totals.num_accepted_tokens_per_pos)
        per_pos_rates = [
            (total - last_per_pos[position]) / num_drafts
            for position, total in enumerate(totals.num_accepted_tokens_per_pos)
        ]
        logger.info(
            "%sSpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
            "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
            "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
            self.prefix,
            1 + num_accepted / num_drafts,
            num_accepted / elapsed_s,
            num_draft_tokens / elapsed_s,
            num_accepted,
            num_draft_tokens,
            ", ".join(f"{rate:.3f}" for rate in per_pos_rates),
            100 * num_accepted / num_draft_tokens if num_draft_tokens else 0.0,
        )
