"""The LLM server's Prometheus metrics, through Ray's metrics pipeline.

``RayStatLogger`` is an engine ``StatLogger``: after every step it updates
``ray.util.metrics`` gauges, counters and histograms under the ``serval_``
prefix, tagged with the model and the replica. Ray's metrics agent on each
node serves them on the node's Prometheus endpoint (``ray start
--metrics-export-port``) and the Ray dashboard shows them. Names follow
vLLM's (``vllm:time_to_first_token_seconds`` -> ``serval_time_to_first_token_seconds``).
"""

from __future__ import annotations

from ray.util import metrics

from engine.metrics import IterationStats
from engine.sched.kv_transfer import KVTransferStats
from engine.sched.scheduler import SchedulerStats
from engine.sched.spec_decode_stats import SpecDecodingStats

TAG_KEYS = ("model_name", "replica")
# Seconds; vLLM's buckets for request-level latencies, finer ones for per-token latencies.
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0]
REQUEST_LATENCY_BUCKETS += [240.0, 480.0, 960.0, 1920.0, 7680.0]
TOKEN_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TOKEN_LATENCY_BUCKETS += [20.0, 40.0, 80.0]


def _histogram(name: str, description: str, boundaries: list[float]) -> metrics.Histogram:
    return metrics.Histogram(name, description, boundaries=boundaries, tag_keys=TAG_KEYS)


class RayStatLogger:
    """Exports one replica's engine statistics (see the module docstring); cheap enough to run every step."""

    def __init__(self, model_name: str, replica: str) -> None:
        self.tags = {"model_name": model_name, "replica": replica}
        self.num_requests_running = metrics.Gauge("serval_num_requests_running", "Requests running.", tag_keys=TAG_KEYS)
        self.num_requests_waiting = metrics.Gauge(
            "serval_num_requests_waiting", "Requests waiting to run.", tag_keys=TAG_KEYS
        )
        self.kv_cache_usage = metrics.Gauge("serval_kv_cache_usage_perc", "KV-cache usage, 0 to 1.", tag_keys=TAG_KEYS)
        self.prefix_cache_queries = metrics.Counter(
            "serval_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", tag_keys=TAG_KEYS
        )
        self.prefix_cache_hits = metrics.Counter(
            "serval_prefix_cache_hits", "Prompt tokens found in the prefix cache.", tag_keys=TAG_KEYS
        )
        self.num_preemptions = metrics.Counter("serval_num_preemptions", "Preemptions.", tag_keys=TAG_KEYS)
        self.lora_slot_swaps = metrics.Counter("serval_lora_slot_swaps", "LoRA slot swaps.", tag_keys=TAG_KEYS)
        self.lora_step_loads = metrics.Counter("serval_lora_step_loads", "LoRA reads on a step.", tag_keys=TAG_KEYS)
        self.prompt_tokens = metrics.Counter("serval_prompt_tokens", "Prompt tokens prefilled.", tag_keys=TAG_KEYS)
        self.generation_tokens = metrics.Counter("serval_generation_tokens", "Tokens generated.", tag_keys=TAG_KEYS)
        self.request_success = metrics.Counter(
            "serval_request_success", "Requests finished, by finish reason.", tag_keys=(*TAG_KEYS, "finished_reason")
        )
        self._init_latency_histograms()
        self.kv_transfer = KVTransferMetrics()
        self.spec_decode: SpecDecodeMetrics | None = None  # made at the first step that carries its stats
        # The scheduler's counters are totals since start; Ray counters take increments.
        self._last_preemptions = self._last_queries = self._last_hits = self._last_swaps = self._last_step_loads = 0

    def _init_latency_histograms(self) -> None:
        """Per-token latencies (observed every step) and per-request ones (observed when a request finishes)."""
        self.time_to_first_token = _histogram(
            "serval_time_to_first_token_seconds",
            "Time to first token.",
            sorted({*TOKEN_LATENCY_BUCKETS, *REQUEST_LATENCY_BUCKETS}),
        )
        self.inter_token_latency = _histogram(
            "serval_inter_token_latency_seconds", "Inter-token latency.", TOKEN_LATENCY_BUCKETS
        )
        self.time_per_output_token = _histogram(
            "serval_request_time_per_output_token_seconds",
            "Mean time per output token of a request.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e_latency = _histogram(
            "serval_e2e_request_latency_seconds", "End-to-end request latency.", REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = _histogram(
            "serval_request_queue_time_seconds", "Time waiting before first running.", REQUEST_LATENCY_BUCKETS
        )
        self.prefill_time = _histogram(
            "serval_request_prefill_time_seconds", "First admitted -> first token.", REQUEST_LATENCY_BUCKETS
        )
        self.decode_time = _histogram(
            "serval_request_decode_time_seconds", "First token -> last token.", REQUEST_LATENCY_BUCKETS
        )

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        tags = self.tags
        self.num_requests_running.set(scheduler_stats.num_running_reqs, tags)
        self.num_requests_waiting.set(scheduler_stats.num_waiting_reqs, tags)
        self.kv_cache_usage.set(scheduler_stats.kv_cache_usage, tags)
        self._add_total(self.num_preemptions, "_last_preemptions", scheduler_stats.num_preemptions)
        prefix = scheduler_stats.prefix_cache_stats
        self._add_total(self.prefix_cache_queries, "_last_queries", prefix.num_queried_tokens)
        self._add_total(self.prefix_cache_hits, "_last_hits", prefix.num_hit_tokens)
        if iteration_stats.num_prompt_tokens:
            self.prompt_tokens.inc(iteration_stats.num_prompt_tokens, tags)
        if iteration_stats.num_generation_tokens:
            self.generation_tokens.inc(iteration_stats.num_generation_tokens, tags)
        for ttft in iteration_stats.time_to_first_tokens_s:
            self.time_to_first_token.observe(ttft, tags)
        for itl in iteration_stats.inter_token_latencies_s:
            self.inter_token_latency.observe(itl, tags)
        for finished in iteration_stats.finished_requests:
            self.request_success.inc(1, {**tags, "finished_reason": finished.finish_reason})
            self.e2e_latency.observe(finished.e2e_latency_s, tags)
            self.queue_time.observe(finished.queued_time_s, tags)
            self.prefill_time.observe(finished.prefill_time_s, tags)
            self.decode_time.observe(finished.decode_time_s, tags)
            if finished.num_generation_tokens > 1:
                self.time_per_output_token.observe(finished.mean_time_per_output_token_s, tags)
        if scheduler_stats.kv_transfer_stats is not None:
            self.kv_transfer.record(scheduler_stats.kv_transfer_stats, iteration_stats.kv_load_latencies_s, tags)
        if scheduler_stats.lora_counts is not None:  # the workers' device-slot swaps and loads on the step's path
            self._add_total(self.lora_slot_swaps, "_last_swaps", scheduler_stats.lora_counts.num_slot_swaps)
            self._add_total(self.lora_step_loads, "_last_step_loads", scheduler_stats.lora_counts.num_step_loads)
        if scheduler_stats.spec_decoding_stats is not None:
            if self.spec_decode is None:
                self.spec_decode = SpecDecodeMetrics()
            self.spec_decode.record(scheduler_stats.spec_decoding_stats, tags)

    def _add_total(self, counter: metrics.Counter, last_attr: str, total: int) -> None:
        increment = total - getattr(self, last_attr)
        if increment > 0:
            counter.inc(increment, self.tags)
            setattr(self, last_attr, total)

    def log(self) -> None:
        """Nothing to print: Ray's metrics agent exports continuously."""


class KVTransferMetrics:
    """Disaggregated prefill, per engine: KV blocks saved (prefill pool) and loaded (decode pool)."""

    def __init__(self) -> None:
        self.saved_bytes = metrics.Counter(
            "serval_kv_transfer_saved_bytes", "KV bytes a prefill engine handed off.", tag_keys=TAG_KEYS
        )
        self.loaded_bytes = metrics.Counter(
            "serval_kv_transfer_loaded_bytes", "KV bytes a decode engine received.", tag_keys=TAG_KEYS
        )
        self.loaded_blocks = metrics.Counter(
            "serval_kv_transfer_loaded_blocks", "KV blocks received.", tag_keys=TAG_KEYS
        )
        self.skipped_blocks = metrics.Counter(
            "serval_kv_transfer_skipped_blocks",
            "Remote KV blocks not transferred: the decode side's prefix cache held them.",
            tag_keys=TAG_KEYS,
        )
        self.failed_loads = metrics.Counter(
            "serval_kv_transfer_failed_loads",
            "KV loads that failed (the decode side computed the KV).",
            tag_keys=TAG_KEYS,
        )
        self.latency = _histogram(
            "serval_kv_transfer_latency_seconds", "Time to load one request's KV.", TOKEN_LATENCY_BUCKETS
        )
        self._last: dict[str, int] = {}

    def record(self, stats: KVTransferStats, load_latencies_s: list[float], tags: dict) -> None:
        for counter, total in (
            (self.saved_bytes, stats.num_saved_bytes),
            (self.loaded_bytes, stats.num_loaded_bytes),
            (self.loaded_blocks, stats.num_loaded_blocks),
            (self.skipped_blocks, stats.num_skipped_blocks),
            (self.failed_loads, stats.num_failed_loads),
        ):
            increment = total - self._last.get(counter.info["name"], 0)
            if increment > 0:
                counter.inc(increment, tags)
                self._last[counter.info["name"]] = total
        for latency in load_latencies_s:
            self.latency.observe(latency, tags)


class SpecDecodeMetrics:
    """Speculative decoding, per engine, as vLLM's ``vllm:spec_decode_*`` counters: verified drafts, their
    tokens, the tokens accepted, and per draft position (``position`` "0" is the first drafted token) the
    drafts whose token there was accepted. Acceptance rate: accepted / draft tokens; mean acceptance
    length: 1 + accepted / drafts."""

    def __init__(self) -> None:
        self.num_drafts = metrics.Counter(
            "serval_spec_decode_num_drafts", "Draft steps verified (a request's drafts in one step).", tag_keys=TAG_KEYS
        )
        self.num_draft_tokens = metrics.Counter(
            "serval_spec_decode_num_draft_tokens", "Draft tokens verified.", tag_keys=TAG_KEYS
        )
        self.num_accepted_tokens = metrics.Counter(
            "serval_spec_decode_num_accepted_tokens", "Draft tokens accepted.", tag_keys=TAG_KEYS
        )
        self.num_accepted_tokens_per_pos = metrics.Counter(
            "serval_spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this position was accepted.",
            tag_keys=(*TAG_KEYS, "position"),
        )
        # The scheduler's counts are totals since start; Ray counters take increments.
        self._last = SpecDecodingStats(num_spec_tokens=0)

    def record(self, stats: SpecDecodingStats, tags: dict) -> None:
        last = self._last
        for counter, total, last_total in (
            (self.num_drafts, stats.num_drafts, last.num_drafts),
            (self.num_draft_tokens, stats.num_draft_tokens, last.num_draft_tokens),
            (self.num_accepted_tokens, stats.num_accepted_tokens, last.num_accepted_tokens),
        ):
            if total > last_total:
                counter.inc(total - last_total, tags)
        last_per_pos = last.num_accepted_tokens_per_pos
        for position, total in enumerate(stats.num_accepted_tokens_per_pos):
            increment = total - (last_per_pos[position] if position < len(last_per_pos) else 0)
            if increment > 0:
                self.num_accepted_tokens_per_pos.inc(increment, {**tags, "position": str(position)})
        self._last = stats.copy()


class RemotePrefillMetrics:
    """A decode replica's view of the prefill pool: requests waiting on it, prefill time, failures."""

    def __init__(self, model_name: str, replica: str) -> None:
        self.tags = {"model_name": model_name, "replica": replica}
        self.queue = metrics.Gauge("serval_prefill_queue", "Requests waiting for the prefill pool.", tag_keys=TAG_KEYS)
        self.prefill_time = _histogram(
            "serval_remote_prefill_seconds",
            "Remote prefill round trip (queue, prefill, KV hand-off).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.failures = metrics.Counter(
            "serval_remote_prefill_failures", "Remote prefills that failed or timed out.", tag_keys=TAG_KEYS
        )

    def set_queue(self, num_waiting: int) -> None:
        self.queue.set(num_waiting, self.tags)

    def observe_prefill(self, seconds: float) -> None:
        self.prefill_time.observe(seconds, self.tags)

    def count_failure(self) -> None:
        self.failures.inc(1, self.tags)


ROUTER_TAG_KEYS = TAG_KEYS  # model_name: the deployment's model; replica: the target replica (as the engine's)


class RouterMetrics:
    """``KVAwareRouter``'s view, per target replica: decisions (by reason), prompt tokens it routed and how
    many of them it predicted the replica's prefix cache held (compare ``serval_prefix_cache_hits``, the
    realized hits, by the same ``replica`` tag), the load it saw and the blocks it believes each holds."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.decisions = metrics.Counter(
            "serval_router_decisions",
            "Requests routed, by reason (prefix, load, session, fallback: Serve took a lower-ranked replica).",
            tag_keys=(*ROUTER_TAG_KEYS, "reason"),
        )
        self.prompt_tokens = metrics.Counter(
            "serval_router_prompt_tokens", "Prompt tokens of the requests routed.", tag_keys=ROUTER_TAG_KEYS
        )
        self.predicted_hit_tokens = metrics.Counter(
            "serval_router_predicted_hit_tokens",
            "Prompt tokens the router predicted the replica's prefix cache held.",
            tag_keys=ROUTER_TAG_KEYS,
        )
        self.replica_load = metrics.Gauge(
            "serval_router_replica_load",
            "Requests running or waiting on the replica, as the router sees them.",
            tag_keys=ROUTER_TAG_KEYS,
        )
        self.indexed_blocks = metrics.Gauge(
            "serval_router_indexed_blocks", "KV blocks the router believes the replica holds.", tag_keys=ROUTER_TAG_KEYS
        )
        # Tagged by the replica ranked first, like every serval_* series (each carries model_name and replica).
        self.routing_seconds = metrics.Histogram(
            "serval_router_choose_seconds",
            "Time to hash and score one request, by the replica ranked first.",
            boundaries=[1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2],
            tag_keys=ROUTER_TAG_KEYS,
        )

    def _tags(self, replica: str) -> dict:
        return {"model_name": self.model_name, "replica": replica}

    def record_prompt(self, replica: str, num_prompt_tokens: int, num_predicted_hit_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens, self._tags(replica))
        if num_predicted_hit_tokens:
            self.predicted_hit_tokens.inc(num_predicted_hit_tokens, self._tags(replica))

    def record_routing_time(self, replica: str, seconds: float) -> None:
        self.routing_seconds.observe(seconds, self._tags(replica))

    def record_decision(self, replica: str, reason: str, load: int) -> None:
        self.decisions.inc(1, {**self._tags(replica), "reason": reason})
        self.replica_load.set(load, self._tags(replica))

    def record_index(self, index) -> None:
        """``index``: a ``deployments.kv_index.KVIndex``."""
        for replica, view in index.replicas.items():
            self.indexed_blocks.set(len(view.held), self._tags(replica))
            self.replica_load.set(view.load, self._tags(replica))


class MigrationMetrics:
    """The ingress's request migrations (``deployments.migration``): ``serval_migrations``, by model, by the
    ingress replica that moved them, and by kind (``continued``: a stream resumed mid-way; ``resent``: a
    request sent again whole before anything of it was sent)."""

    def __init__(self, replica: str) -> None:
        self.replica = replica
        self.migrations = metrics.Counter(
            "serval_migrations",
            "Requests moved to another LLM-server replica after the one serving them died, by kind.",
            tag_keys=(*TAG_KEYS, "kind"),
        )

    def record(self, model_name: str, kind: str) -> None:
        self.migrations.inc(1, {"model_name": model_name, "replica": self.replica, "kind": kind})


class LoRAMetrics:
    """One LLM-server replica's LoRA adapters (``lora_models.LoRAEvents``), counted where its adapter set changes:
    ``serval_lora_adapters_loaded`` (held now), ``serval_lora_adapter_loads``, ``serval_lora_adapter_evictions``
    (dropped least recently used: the replica's cap or Serve's multiplexing), ``serval_lora_requests`` (by
    adapter). The engine's device-slot swaps and loads on the step's path are ``RayStatLogger``'s."""

    def __init__(self, model_name: str, replica: str) -> None:
        self.tags = {"model_name": model_name, "replica": replica}
        self.held = metrics.Gauge("serval_lora_adapters_loaded", "LoRA adapters held by the replica.", TAG_KEYS)
        self.loads = metrics.Counter("serval_lora_adapter_loads", "LoRA adapters checked and added.", TAG_KEYS)
        self.evictions = metrics.Counter("serval_lora_adapter_evictions", "LoRA adapters dropped (LRU).", TAG_KEYS)
        self.requests = metrics.Counter("serval_lora_requests", "Requests by LoRA adapter.", (*TAG_KEYS, "adapter"))

    def adapters_changed(self, change: str, num_held: int) -> None:
        """``change``: ``loaded``, ``evicted`` or ``unloaded``; ``num_held``: adapters held after it."""
        counter = {"loaded": self.loads, "evicted": self.evictions}.get(change)
        if counter is not None:
            counter.inc(1, self.tags)
        self.held.set(num_held, self.tags)

    def adapter_request(self, name: str) -> None:
        self.requests.inc(1, {**self.tags, "adapter": name})
