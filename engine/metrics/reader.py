"""An engine's metrics as plain objects, for the offline ``LLM.get_metrics()`` (vLLM's ``vllm.v1.metrics.reader``).

Names are the replicas' Prometheus names (deployments/metrics.py) without Ray's ``ray_`` prefix or
Prometheus' ``_total`` suffix: vLLM's ``vllm:spec_decode_num_drafts`` is ``serval_spec_decode_num_drafts``
here and ``ray_serval_spec_decode_num_drafts_total`` in Prometheus. Counters count since the engine
started; gauges are the scheduler's state after the last step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.metrics.engine_stats import EngineStats


@dataclass(frozen=True)
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Counter(Metric):
    """A count since start."""

    value: int = 0


@dataclass(frozen=True)
class Gauge(Metric):
    """A current value."""

    value: float = 0.0


@dataclass(frozen=True)
class Vector(Metric):
    """Counts since start, one per position (Prometheus: one counter series per ``position`` label)."""

    values: list[int] = field(default_factory=list)


def engine_metrics(stats: EngineStats, labels: dict[str, str]) -> list[Metric]:
    """The metrics of one ``EngineStats`` snapshot, each with ``labels``; the ``serval_spec_decode_*``
    ones only with speculative decoding configured."""
    figures: list[tuple[type, str, object]] = [
        (Gauge, "serval_num_requests_running", stats.num_running_reqs),
        (Gauge, "serval_num_requests_waiting", stats.num_waiting_reqs),
        (Gauge, "serval_kv_cache_usage_perc", stats.kv_cache_usage),
        (Counter, "serval_prompt_tokens", stats.num_prompt_tokens_total),
        (Counter, "serval_generation_tokens", stats.num_generated_tokens_total),
        (Counter, "serval_num_preemptions", stats.num_preemptions_total),
        (Counter, "serval_prefix_cache_queries", stats.prefix_cache_queries),
        (Counter, "serval_prefix_cache_hits", stats.prefix_cache_hits),
    ]
    spec = stats.spec_decoding
    if spec is not None:
        figures += [
            (Counter, "serval_spec_decode_num_drafts", spec.num_drafts),
            (Counter, "serval_spec_decode_num_draft_tokens", spec.num_draft_tokens),
            (Counter, "serval_spec_decode_num_accepted_tokens", spec.num_accepted_tokens),
            (Vector, "serval_spec_decode_num_accepted_tokens_per_pos", list(spec.num_accepted_tokens_per_pos)),
        ]
    return [kind(name, dict(labels), value) for kind, name, value in figures]  # labels: one copy each
