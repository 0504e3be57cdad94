"""Speculative decoding's metrics from the scheduler's ``SpecDecodingStats`` (totals since start): the
replicas' Prometheus counters (deployments/metrics.py, read back from a real Ray node's endpoint), vLLM's
"SpecDecoding metrics" log line, ``EngineStats``' summary, the reader's objects, and the dashboard row.
"""

from __future__ import annotations

import logging
import re
import time

import pytest

from engine.metrics import EngineStats, EngineTotals, IterationStats, LoggingStatLogger
from engine.metrics.reader import Counter, Vector, engine_metrics
from engine.sched.kv_cache_manager import PrefixCacheStats
from engine.sched.scheduler import SchedulerStats
from engine.sched.spec_decode_stats import SpecDecodingStats
from serval.dashboard import load_dashboard, panel_queries_by_row
from tests.serval.test_dashboard import serval_metric_series

SPEC_SERIES = {
    "ray_serval_spec_decode_num_drafts_total",
    "ray_serval_spec_decode_num_draft_tokens_total",
    "ray_serval_spec_decode_num_accepted_tokens_total",
    "ray_serval_spec_decode_num_accepted_tokens_per_pos_total",
}


def spec_stats(num_drafts: int, num_draft_tokens: int, per_pos: list[int]) -> SpecDecodingStats:
    """Totals of 3-token drafts: ``per_pos[i]`` drafts had token i accepted (so accepted = sum)."""
    return SpecDecodingStats(3, num_drafts, num_draft_tokens, sum(per_pos), list(per_pos))


def scheduler_stats(spec: SpecDecodingStats | None, num_running: int = 1) -> SchedulerStats:
    return SchedulerStats(num_running, 0, 0.25, 0, PrefixCacheStats(), spec_decoding_stats=spec)


# The totals at two steps: 4 then 10 drafts of 3 tokens.
FIRST = spec_stats(4, 12, [3, 2, 1])
SECOND = spec_stats(10, 30, [8, 5, 2])


def test_engine_stats_summarize_spec_decoding_since_start():
    stats = EngineStats.derive(scheduler_stats(SECOND), EngineTotals(), 10, 5)
    summary = stats.spec_decoding
    assert (summary.num_drafts, summary.num_draft_tokens, summary.num_accepted_tokens) == (10, 30, 15)
    assert summary.num_accepted_tokens_per_pos == (8, 5, 2)
    assert summary.acceptance_rate == pytest.approx(0.5)
    assert summary.mean_acceptance_length == pytest.approx(2.5)
    assert EngineStats.derive(scheduler_stats(None), EngineTotals(), 10, 5).spec_decoding is None


def test_reader_has_spec_decode_counters_only_when_configured():
    with_spec = {
        m.name: m for m in engine_metrics(EngineStats.derive(scheduler_stats(SECOND), EngineTotals(), 10, 5), {})
    }
    assert with_spec["serval_spec_decode_num_drafts"] == Counter("serval_spec_decode_num_drafts", {}, 10)
    assert with_spec["serval_spec_decode_num_accepted_tokens"].value == 15
    assert with_spec["serval_spec_decode_num_draft_tokens"].value == 30
    per_pos = with_spec["serval_spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_pos, Vector) and per_pos.values == [8, 5, 2]
    without = engine_metrics(EngineStats.derive(scheduler_stats(None), EngineTotals(), 10, 5), {})
    assert not [m.name for m in without if "spec_decode" in m.name]


def test_reader_names_are_the_prometheus_names():
    """Every reader metric is a deployments/metrics.py series, less Ray's prefix and Prometheus' suffix."""
    series = set(serval_metric_series())
    stats = EngineStats.derive(scheduler_stats(SECOND), EngineTotals(), 10, 5)
    for metric in engine_metrics(stats, {}):
        suffix = "" if type(metric).__name__ == "Gauge" else "_total"
        assert f"ray_{metric.name}{suffix}" in series, metric.name


def test_dashboard_row_reads_the_spec_decode_series():
    row = panel_queries_by_row(load_dashboard())["Speculative decoding"]
    names = {name for _, expr in row for name in re.findall(r"\bray_serval_\w+", expr)}
    assert names == SPEC_SERIES
    assert SPEC_SERIES <= set(serval_metric_series())
    titles = [title for title, _ in row]
    assert {"Draft acceptance rate", "Mean acceptance length", "Per-position acceptance rate"} <= set(titles)


LINE = re.compile(
    r"\[m\] SpecDecoding metrics: Mean acceptance length: (?P<length>[\d.]+), "
    r"Accepted throughput: (?P<accepted_tps>[\d.]+) tokens/s, Drafted throughput: (?P<drafted_tps>[\d.]+) tokens/s, "
    r"Accepted: (?P<accepted>\d+) tokens, Drafted: (?P<drafted>\d+) tokens, "
    r"Per-position acceptance rate: (?P<per_pos>[\d., ]+), Avg Draft acceptance rate: (?P<rate>[\d.]+)%"
)


def logged_line(stat_logger: LoggingStatLogger, spec: SpecDecodingStats, caplog, interval_s: float) -> str:
    """What ``log()`` prints after one step whose scheduler reported ``spec``, ``interval_s`` after the last line."""
    caplog.clear()
    stat_logger.record(scheduler_stats(spec), IterationStats(num_generation_tokens=4))
    stat_logger.last_log_time = time.monotonic() - interval_s  # the interval the line covers
    with caplog.at_level(logging.INFO, logger="engine.metrics"):
        stat_logger.log()
    return caplog.text


def test_log_line_covers_the_interval_since_the_last_line(caplog):
    stat_logger = LoggingStatLogger("m")
    first = LINE.search(logged_line(stat_logger, FIRST, caplog, 4.0))
    assert first and (first["accepted"], first["drafted"]) == ("6", "12")
    # The second interval: 6 drafts, 18 draft tokens, 9 accepted (5, 3, 1 by position).
    second = LINE.search(logged_line(stat_logger, SECOND, caplog, 3.0))
    assert second, caplog.text
    assert (second["accepted"], second["drafted"]) == ("9", "18")
    assert float(second["length"]) == pytest.approx(1 + 9 / 6, abs=0.005)
    assert second["per_pos"] == f"{5 / 6:.3f}, {3 / 6:.3f}, {1 / 6:.3f}"
    assert float(second["rate"]) == pytest.approx(50.0)
    assert float(second["accepted_tps"]) == pytest.approx(9 / 3.0, rel=0.05)
    assert float(second["drafted_tps"]) == pytest.approx(18 / 3.0, rel=0.05)
    # No drafts since the last line, or no speculation: no line.
    assert "SpecDecoding" not in logged_line(stat_logger, SECOND, caplog, 3.0)
    assert "SpecDecoding" not in logged_line(LoggingStatLogger("m"), None, caplog, 3.0)


@pytest.fixture(scope="module")
def local_ray():
    """A fresh one-node Ray whose metrics agent serves Prometheus on ``metrics_port``, reporting every 0.2 s."""
    import ray

    from serval.launcher.head import free_port
    from tests.serve.cluster import LOOPBACK, OBJECT_STORE_BYTES

    port = free_port()
    if ray.is_initialized():  # the serving tests' session driver (tests/serve's ray_head): no later test uses it
        ray.shutdown()
    ray.init(
        address="local",
        _node_ip_address=LOOPBACK,
        num_cpus=1,
        object_store_memory=OBJECT_STORE_BYTES,
        include_dashboard=False,
        logging_level="warning",
        log_to_driver=False,
        _metrics_export_port=port,
        _system_config={"metrics_report_interval_ms": 200},
    )
    try:
        yield f"http://{LOOPBACK}:{port}/metrics"
    finally:
        ray.shutdown()


def scrape_until(url: str, done, timeout_s: float = 60) -> dict[tuple, float]:
    """The node's serval_* samples as {(name, model_name, replica, position): value} once ``done`` holds."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout_s
    while True:
        samples = {}
        for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
            for sample in family.samples:
                if sample.name.startswith("ray_serval_"):
                    labels = sample.labels
                    key = (sample.name, labels.get("model_name"), labels.get("replica"), labels.get("position"))
                    samples[key] = sample.value
        if done(samples):
            return samples
        assert time.monotonic() < deadline, f"not reported: {sorted(samples)}"
        time.sleep(0.3)


@pytest.mark.slow
def test_replica_counters_add_the_scheduler_totals_differences(local_ray):
    from deployments.metrics import RayStatLogger

    speculating, plain = RayStatLogger("m", "r1"), RayStatLogger("m", "r2")
    for spec in (FIRST, FIRST, SECOND):  # a step with no new draft adds nothing
        speculating.record(scheduler_stats(spec), IterationStats(num_generation_tokens=2))
        plain.record(scheduler_stats(None), IterationStats(num_generation_tokens=2))
    assert plain.spec_decode is None
    expected = {
        ("ray_serval_spec_decode_num_drafts_total", "m", "r1", None): 10,
        ("ray_serval_spec_decode_num_draft_tokens_total", "m", "r1", None): 30,
        ("ray_serval_spec_decode_num_accepted_tokens_total", "m", "r1", None): 15,
        ("ray_serval_spec_decode_num_accepted_tokens_per_pos_total", "m", "r1", "0"): 8,
        ("ray_serval_spec_decode_num_accepted_tokens_per_pos_total", "m", "r1", "1"): 5,
        ("ray_serval_spec_decode_num_accepted_tokens_per_pos_total", "m", "r1", "2"): 2,
    }
    samples = scrape_until(
        local_ray,
        lambda s: (
            all(s.get(k) == v for k, v in expected.items())
            and s.get(("ray_serval_generation_tokens_total", "m", "r2", None)) == 6
        ),
    )
    spec_samples = {key: value for key, value in samples.items() if "spec_decode" in key[0]}
    assert spec_samples == expected  # nothing from the replica without speculation


@pytest.mark.slow
def test_async_engine_reports_ngram_speculation(tiny_checkpoint, caplog):
    """The serving path: the core process's stats reach get_stats() and the log line (real loggers)."""
    import asyncio

    from engine import SamplingParams
    from engine.async_llm import AsyncLLM
    from engine.engine_args import EngineArgs

    stat_logger = LoggingStatLogger("m")
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    args = EngineArgs(model=tiny_checkpoint("llama"), dtype="float32", max_model_len=64, speculative_config=ngram)
    engine = AsyncLLM.from_engine_args(args, stat_loggers=[stat_logger])
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12)

    async def run() -> None:
        async for _ in engine.generate({"prompt_token_ids": [10, 11, 12, 13] * 4}, params, "r"):
            pass

    try:
        asyncio.run(run())
        summary = engine.get_stats().spec_decoding
    finally:
        engine.shutdown()
    assert summary.num_draft_tokens > 0 and 0 <= summary.num_accepted_tokens <= summary.num_draft_tokens
    assert summary.acceptance_rate == pytest.approx(summary.num_accepted_tokens / summary.num_draft_tokens)
    with caplog.at_level(logging.INFO, logger="engine.metrics"):
        stat_logger.log()
    line = LINE.search(caplog.text)
    assert line and int(line["drafted"]) == summary.num_draft_tokens, caplog.text
