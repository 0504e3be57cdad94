"""One ``serval bench serve`` run's results: per-request timings, the metrics ``vllm bench serve`` reports
(with its names), goodput under latency SLOs, and the summary table.

Times inside :class:`RequestResult` and the report's raw per-request lists are in seconds (as in vLLM's
detailed results); the summary metrics (``mean_ttft_ms``, ...) are in milliseconds.
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass, field

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
SLO_METRICS = ("ttft", "tpot", "e2el")
NUM_ERRORS_KEPT = 5  # distinct error messages kept in the report


@dataclass
class RequestResult:
    """One request's timeline, in seconds since the benchmark started."""

    prompt_len: int  # the dataset's count
    start_time: float
    end_time: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each streamed chunk carrying tokens
    num_output_tokens: int = 0
    num_prompt_tokens: int | None = None  # the server's count (usage), when it sent one
    error: str | None = None

    @property
    def is_success(self) -> bool:
        return self.error is None

    @property
    def input_len(self) -> int:
        """The prompt's tokens: the server's count when it sent one (a chat template adds tokens), else the
        dataset's."""
        return self.prompt_len if self.num_prompt_tokens is None else self.num_prompt_tokens

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start_time

    @property
    def itls(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def e2el(self) -> float:
        return self.end_time - self.start_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.num_output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.num_output_tokens - 1)


def parse_percentiles(text: str) -> list[float]:
    """``"50,90,99"`` -> ``[50.0, 90.0, 99.0]``; each in [0, 100]."""
    try:
        values = [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        values = []
    if not values or any(not 0 <= value <= 100 for value in values):
        raise argparse.ArgumentTypeError(f"percentiles are comma-separated numbers in [0, 100], got {text!r}")
    return values


def parse_metric_names(text: str) -> list[str]:
    """``"ttft,tpot"`` -> ``["ttft", "tpot"]``; each one of :data:`METRICS`."""
    names = [item.strip() for item in text.split(",") if item.strip()]
    if not names or any(name not in METRICS for name in names):
        raise argparse.ArgumentTypeError(f"metrics are comma-separated names in {', '.join(METRICS)}, got {text!r}")
    return names


def parse_goodput(text: str) -> tuple[str, float]:
    """One vLLM ``--goodput`` pair: ``"ttft:500"`` -> ``("ttft", 500.0)`` (milliseconds, not negative)."""
    name, _, value = text.partition(":")
    try:
        milliseconds = float(value)
    except ValueError:
        milliseconds = -1.0
    if name.strip() not in SLO_METRICS or milliseconds < 0:
        raise argparse.ArgumentTypeError(
            f"a goodput SLO is NAME:MILLISECONDS with NAME in {', '.join(SLO_METRICS)}, got {text!r}"
        )
    return name.strip(), milliseconds


def parse_slos(text: str) -> list[tuple[str, float]]:
    """The deprecated ``--slo`` form: ``"ttft=500,tpot=50"`` -> ``[("ttft", 500.0), ("tpot", 50.0)]``."""
    return [parse_goodput(item.replace("=", ":")) for item in text.split(",")]


def build_report(
    results: list[RequestResult],
    duration_s: float,
    percentiles: list[float],
    percentile_metrics: list[str] = METRICS,
    slos: dict[str, float] | None = None,
) -> dict:
    """The metrics of one measured run, with vLLM's keys, plus the per-request lists.

    Throughputs divide by ``duration_s`` (first dispatch to last completion); token totals and latency
    statistics count completed requests only, and a request's input tokens are the server's count when it
    sent one (vLLM's rule). ``mean_``/``median_``/``std_``/``p{N}_{metric}_ms`` are written for each of
    ``percentile_metrics``. ``request_goodput`` (completed requests per second meeting every SLO) and
    ``goodput_fraction`` (of all requests) are None without ``slos``.
    """
    completed = [result for result in results if result.is_success]
    num_input_tokens = sum(result.input_len for result in completed)
    num_output_tokens = sum(result.num_output_tokens for result in completed)
    report = {
        "duration": duration_s,
        "completed": len(completed),
        "failed": len(results) - len(completed),
        "first_errors": first_errors(results),
        "total_input_tokens": num_input_tokens,
        "total_output_tokens": num_output_tokens,
        "request_throughput": len(completed) / duration_s,
        "output_throughput": num_output_tokens / duration_s,
        "total_token_throughput": (num_input_tokens + num_output_tokens) / duration_s,
        "max_concurrent_requests": max_concurrent_requests(results),
        "percentile_metrics": list(percentile_metrics),
        "metric_percentiles": percentiles,
        "goodput_config": slos or None,
    }
    report.update(goodput(completed, len(results), duration_s, slos))
    samples = latencies_ms(completed)
    for name in percentile_metrics:
        report.update(latency_stats(name, samples[name], percentiles))
    report.update(per_request_lists(results))
    return report


def latencies_ms(completed: list[RequestResult]) -> dict[str, list[float]]:
    """Each metric's samples in ms: one per request, ITL one per gap between streamed chunks."""
    return {
        "ttft": [result.ttft * 1e3 for result in completed],
        "tpot": [result.tpot * 1e3 for result in completed if result.tpot is not None],
        "itl": [itl * 1e3 for result in completed for itl in result.itls],
        "e2el": [result.e2el * 1e3 for result in completed],
    }


def latency_stats(name: str, values: list[float], percentiles: list[float]) -> dict[str, float]:
    """``mean_{name}_ms``, ``median_``, ``std_`` and ``p{N}_`` for each percentile; zeros without samples."""
    ordered = sorted(values)
    stats = {
        f"mean_{name}_ms": statistics.fmean(ordered) if ordered else 0.0,
        f"median_{name}_ms": percentile(ordered, 50),
        f"std_{name}_ms": statistics.pstdev(ordered) if ordered else 0.0,
    }
    for q in percentiles:
        stats[f"p{percentile_label(q)}_{name}_ms"] = percentile(ordered, q)
    return stats


def percentile(ordered: list[float], q: float) -> float:
    """The ``q``-th percentile of sorted values, interpolated linearly (numpy's default); 0 when empty."""
    if not ordered:
        return 0.0
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def percentile_label(q: float) -> str:
    """99.0 -> "99", 99.9 -> "99.9"."""
    return str(int(q)) if q == int(q) else str(q)


def goodput(
    completed: list[RequestResult], num_requests: int, duration_s: float, slos: dict[str, float] | None
) -> dict[str, float | None]:
    if not slos:
        return {"request_goodput": None, "goodput_fraction": None}
    num_good = sum(is_within_slos(result, slos) for result in completed)
    fraction = num_good / num_requests if num_requests else 0.0
    return {"request_goodput": num_good / duration_s, "goodput_fraction": fraction}


def is_within_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    # A request of one token has no TPOT; like vLLM, it counts as 0 (it meets any TPOT SLO).
    measured_ms = {"ttft": result.ttft * 1e3, "tpot": (result.tpot or 0.0) * 1e3, "e2el": result.e2el * 1e3}
    return all(measured_ms[name] <= limit for name, limit in slos.items())


def max_concurrent_requests(results: list[RequestResult]) -> int:
    """The most requests in flight at once (sent, not yet finished), failed ones included."""
    # At equal times an end sorts before a start (-1 < +1): a request that ends as another starts never overlaps it.
    events = sorted([(result.start_time, 1) for result in results] + [(result.end_time, -1) for result in results])
    num_in_flight = peak = 0
    for _, change in events:
        num_in_flight += change
        peak = max(peak, num_in_flight)
    return peak


def first_errors(results: list[RequestResult]) -> list[str]:
    """The first few distinct error messages, in the order requests were sent."""
    errors: list[str] = []
    for result in results:
        if result.error is not None and result.error not in errors and len(errors) < NUM_ERRORS_KEPT:
            errors.append(result.error)
    return errors


# The per-request lists: in the JSON with --save-detailed only, as in vLLM.
PER_REQUEST_KEYS = (
    "input_lens",
    "output_lens",
    "ttfts",
    "tpots",
    "itls",
    "latencies",
    "start_times",
    "end_times",
    "errors",
)


def per_request_lists(results: list[RequestResult]) -> dict[str, list]:
    """Per-request lists in send order (vLLM's detailed keys), in seconds; a failed request's latencies are
    None (JSON null), its error the message (None for a success)."""
    return {
        "input_lens": [result.input_len for result in results],
        "output_lens": [result.num_output_tokens if result.is_success else 0 for result in results],
        "ttfts": [result.ttft if result.is_success else None for result in results],
        "tpots": [result.tpot if result.is_success else None for result in results],
        "itls": [result.itls if result.is_success else [] for result in results],
        "latencies": [result.e2el if result.is_success else None for result in results],
        "start_times": [result.start_time for result in results],
        "end_times": [result.end_time for result in results],
        "errors": [result.error for result in results],
    }


def format_summary(report: dict) -> str:
    """vLLM's result table."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    rows = [
        ("Successful requests:", report["completed"]),
        ("Failed requests:", report["failed"]),
        ("Maximum request concurrency:", report.get("max_concurrency")),
        ("Peak concurrent requests:", report["max_concurrent_requests"]),
        ("Benchmark duration (s):", f"{report['duration']:.2f}"),
        ("Total input tokens:", report["total_input_tokens"]),
        ("Total generated tokens:", report["total_output_tokens"]),
        ("Request throughput (req/s):", f"{report['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{report['output_throughput']:.2f}"),
        ("Total Token throughput (tok/s):", f"{report['total_token_throughput']:.2f}"),
    ]
    if report["request_goodput"] is not None:
        rows.append(("Request goodput (req/s):", f"{report['request_goodput']:.2f}"))
        rows.append(("Goodput fraction:", f"{report['goodput_fraction']:.3f}"))
    lines += [f"{label:<40} {value}" for label, value in rows]
    for name in report["percentile_metrics"]:
        lines.append("{s:{c}^{n}}".format(s=METRIC_TITLES[name], n=50, c="-"))
        label = name.upper()
        lines.append(f"{f'Mean {label} (ms):':<40} {report[f'mean_{name}_ms']:<10.2f}")
        lines.append(f"{f'Median {label} (ms):':<40} {report[f'median_{name}_ms']:<10.2f}")
        for q in report["metric_percentiles"]:
            key = percentile_label(q)
            lines.append(f"{f'P{key} {label} (ms):':<40} {report[f'p{key}_{name}_ms']:<10.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)
