"""Latency statistics: the arithmetic of one request's phases, and what a real engine run reports.

A stat logger here is a plain sink that keeps what it is given (the
``StatLogger`` protocol), not a stand-in for one of our classes.
"""

from __future__ import annotations

import logging

import pytest

from engine import SamplingParams
from engine.engine_args import EngineArgs
from engine.llm_engine import LLMEngine
from engine.metrics import IterationStats, LoggingStatLogger, RequestTimes
from engine.sched.scheduler import SchedulerStats

MAX_TOKENS = 6
PROMPT_LENGTHS = (3, 20, 45)


class KeepingStatLogger:
    def __init__(self) -> None:
        self.records: list[tuple[SchedulerStats, IterationStats]] = []
        self.num_logs = 0

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self.records.append((scheduler_stats, iteration_stats))

    def log(self) -> None:
        self.num_logs += 1


def test_phases_of_one_request():
    times = RequestTimes(arrival_time=100.0, num_prompt_tokens=7)
    first = IterationStats(now=103.0)
    first.record_tokens(times, 1, first_scheduled_time=101.0)
    assert first.time_to_first_tokens_s == [3.0] and first.num_prompt_tokens == 7
    second = IterationStats(now=104.0)
    second.record_tokens(times, 2, first_scheduled_time=101.0)
    assert second.inter_token_latencies_s == [1.0] and second.num_prompt_tokens == 0
    last = IterationStats(now=106.0)
    last.record_tokens(times, 1, first_scheduled_time=101.0)
    last.record_finished(times, "length")
    (stats,) = last.finished_requests
    assert stats.finish_reason == "length" and stats.num_generation_tokens == 4
    assert (stats.e2e_latency_s, stats.queued_time_s, stats.prefill_time_s) == (6.0, 1.0, 2.0)
    assert (stats.decode_time_s, stats.inference_time_s) == (3.0, 5.0)
    assert stats.mean_time_per_output_token_s == pytest.approx(1.0)


def test_a_request_aborted_before_running_has_zero_length_phases():
    times = RequestTimes(arrival_time=10.0, num_prompt_tokens=3)
    stats = IterationStats(now=12.0)
    stats.record_finished(times, "abort")
    (finished,) = stats.finished_requests
    assert finished.queued_time_s == 2.0 and finished.e2e_latency_s == 2.0
    assert finished.prefill_time_s == finished.decode_time_s == finished.mean_time_per_output_token_s == 0.0


@pytest.fixture(scope="module")
def engine_run(tiny_checkpoint):
    sink = KeepingStatLogger()
    engine = LLMEngine(
        EngineArgs(
            model=tiny_checkpoint("llama"), dtype="float32", max_model_len=128, max_num_batched_tokens=32
        ).create_engine_config(),
        stat_loggers=[sink],
        log_interval_s=0.0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for index, length in enumerate(PROMPT_LENGTHS):
        engine.add_request(str(index), {"prompt_token_ids": list(range(10, 10 + length))}, params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.shutdown()
    return sink


def test_engine_reports_every_token_and_request(engine_run):
    iterations = [iteration for _, iteration in engine_run.records]
    assert engine_run.num_logs == len(iterations)  # log_interval_s=0: log() after every step
    assert sum(i.num_generation_tokens for i in iterations) == MAX_TOKENS * len(PROMPT_LENGTHS)
    assert sum(i.num_prompt_tokens for i in iterations) == sum(PROMPT_LENGTHS)
    assert sum(len(i.time_to_first_tokens_s) for i in iterations) == len(PROMPT_LENGTHS)
    assert sum(len(i.inter_token_latencies_s) for i in iterations) == (MAX_TOKENS - 1) * len(PROMPT_LENGTHS)
    assert all(latency >= 0 for i in iterations for latency in i.time_to_first_tokens_s + i.inter_token_latencies_s)
    assert [s.num_running_reqs for s, _ in engine_run.records][-1] == 0


def test_finished_requests_phases_add_up(engine_run):
    finished = [stats for _, iteration in engine_run.records for stats in iteration.finished_requests]
    assert sorted(s.num_prompt_tokens for s in finished) == sorted(PROMPT_LENGTHS)
    for stats in finished:
        assert stats.finish_reason == "length" and stats.num_generation_tokens == MAX_TOKENS
        assert min(stats.queued_time_s, stats.prefill_time_s, stats.decode_time_s) >= 0
        assert stats.queued_time_s + stats.prefill_time_s + stats.decode_time_s == pytest.approx(stats.e2e_latency_s)
        assert stats.inference_time_s == pytest.approx(stats.prefill_time_s + stats.decode_time_s)
        assert stats.mean_time_per_output_token_s == pytest.approx(stats.decode_time_s / (MAX_TOKENS - 1))


def test_logging_stat_logger_writes_vllms_throughput_line(engine_run, caplog):
    stat_logger = LoggingStatLogger("tiny")
    for scheduler_stats, iteration in engine_run.records[:3]:
        stat_logger.record(scheduler_stats, iteration)
    with caplog.at_level(logging.INFO, logger="engine.metrics"):
        stat_logger.log()
    assert "[tiny] Avg prompt throughput:" in caplog.text and "KV cache usage:" in caplog.text


def test_an_idle_async_engine_keeps_reporting_its_state(tiny_checkpoint):
    """No steps while idle, yet the loggers hear every IDLE_REPORT_INTERVAL_S: gauges read 0, not 'gone'."""
    import time

    from engine.async_llm import AsyncLLM
    from engine.core.core_proc import IDLE_REPORT_INTERVAL_S

    sink = KeepingStatLogger()
    engine = AsyncLLM.from_engine_args(
        EngineArgs(model=tiny_checkpoint("llama"), dtype="float32", max_model_len=128), stat_loggers=[sink]
    )
    try:
        # The same 2.5 intervals as the deadline, ended as soon as the two reports asserted below are in.
        deadline = time.monotonic() + 2.5 * IDLE_REPORT_INTERVAL_S
        while len(sink.records) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        engine.shutdown()
    assert len(sink.records) >= 2
    for scheduler_stats, iteration_stats in sink.records:
        assert (scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs) == (0, 0)
        assert scheduler_stats.kv_cache_usage == 0.0
        assert not iteration_stats.num_generation_tokens and not iteration_stats.finished_requests
