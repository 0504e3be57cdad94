"""Stat loggers: where each step's ``SchedulerStats`` and ``IterationStats`` go.

The async front end calls every logger's ``record`` on its busy-loop thread
after each step, and ``log`` from time to time; loggers must be cheap in
``record``. The serving layer adds one that exports Prometheus metrics
through Ray; ``LoggingStatLogger`` is vLLM's periodic throughput line.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from engine.core.scheduler import SchedulerStats
from engine.metrics.stats import IterationStats

logger = logging.getLogger("engine.metrics")


class StatLogger(Protocol):
    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        """One step's statistics (busy-loop thread; must not block)."""

    def log(self) -> None:
        """Called about every ``log_interval_s``; loggers that aggregate print here."""


class LoggingStatLogger:
    """Logs prompt and generation throughput, queue sizes and cache use, like vLLM's engine log line."""

    def __init__(self, model_name: str = "") -> None:
        self.prefix = f"[{model_name}] " if model_name else ""
        self._reset(time.monotonic())
        self.last_scheduler_stats: SchedulerStats | None = None

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
        self._reset(now)
