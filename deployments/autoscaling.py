"""Autoscaling an LLM-server deployment on a latency objective: ``TTFTPolicy``, a Serve custom autoscaling policy.

    deployment_config:
      autoscaling_config:
        min_replicas: 1
        max_replicas: 2
        upscale_delay_s: 5          # Serve's own keys: how long a wish to scale must last (the cooldowns)
        downscale_delay_s: 60
        metrics_interval_s: 2       # how often each replica reports (Serve's key; default 10 s)
        look_back_period_s: 10
        policy:
          policy_function: deployments.autoscaling:TTFTPolicy
          policy_kwargs: {target_ttft_ms: 500}     # TTFTPolicyOptions; unknown keys fail the deploy

Three parts, Serve-free where they can be:

* the replica side, ``TTFTWindow``: a stat logger keeping the TTFTs of the last ``ttft_window_s``; the
  replica's ``record_autoscaling_stats`` returns its ``report`` (the window's TTFT count, how many missed
  the target, its own percentile, the engine's running and waiting requests), which Serve carries to the
  controller as custom autoscaling metrics;
* the policy, ``decide``: plain data in (``ScalingInputs``), a replica count and its reason out;
* the glue, ``TTFTPolicy``: the callable Serve's controller instantiates once with ``policy_kwargs`` and
  calls every control-loop tick with an ``AutoscalingContext``. Serve then applies
  ``upscale_delay_s`` / ``downscale_delay_s`` (a wish must last that long), the scaling factors and the
  min / max bounds on what it returns.

Serve pickles this module by value into its controller: it imports only the standard library and pydantic at
the top (Ray only where the policy sets its ``serval_autoscaling_*`` gauges, in the controller).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger("ray.serve")

TTFT_POLICY = "deployments.autoscaling:TTFTPolicy"

# The custom metrics a replica reports (Serve merges them with its own ongoing-request counts: keep prefixed).
TTFT_SAMPLES = "serval_ttft_samples"
TTFT_SLOW = "serval_ttft_slow"
TTFT_PERCENTILE_MS = "serval_ttft_percentile_ms"
RUNNING = "serval_running_requests"
WAITING = "serval_waiting_requests"

# Keys of this policy's own state in Serve's policy_state (Serve keeps its delay counters there too).
_SEEN_REPLICAS = "serval_seen_replicas"
_CHANGED_AT = "serval_replicas_changed_at"


class TTFTPolicyOptions(BaseModel):
    """``TTFTPolicy``'s ``policy_kwargs``, checked when the app is built."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    target_ttft_ms: float = Field(gt=0, description="The objective: the TTFT percentile stays at or under this.")
    ttft_percentile: float = Field(90.0, gt=0, lt=100, description="Which TTFT percentile (p90 by default).")
    ttft_window_s: float = Field(
        30.0,
        gt=0,
        description="Each replica's TTFTs of this many seconds count; also how long after a "
        "change of the replica count TTFTs are not acted on (the window still holds the old count's).",
    )
    min_ttft_samples: int = Field(8, ge=1, description="Fewer TTFTs in the window (all replicas): no verdict.")
    max_waiting_per_replica: float = Field(
        4.0,
        ge=0,
        description="Scale up while more requests than this per replica wait (engine queues plus "
        "Serve's handle queues), whatever the TTFTs.",
    )
    idle_requests_per_replica: float = Field(
        1.0,
        ge=0,
        description="Scale down by one while the objective holds and the requests in flight (running and "
        "waiting) fit on one replica fewer at this many each.",
    )


def nearest_rank(values: Sequence[float], percentile: float) -> float:
    """The nearest-rank percentile of ``values`` (not empty)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(percentile / 100 * len(ordered)) - 1)]


def percentile_exceeds(num_slow: int, num_samples: int, percentile: float) -> bool:
    """Whether the nearest-rank ``percentile`` of ``num_samples`` values exceeds a target that ``num_slow``
    of them exceed: it does exactly when more values exceed it than rank past the percentile. Counts add
    across replicas, so the deployment-wide verdict is exact, as no mean of per-replica percentiles is."""
    return num_slow > num_samples - math.ceil(percentile / 100 * num_samples)


class TTFTWindow:
    """The replica's recent TTFTs, as a ``StatLogger`` (``engine.metrics.loggers``): ``record`` runs on the
    engine's front-end thread, ``report`` on the replica's (Serve's autoscaling-metrics task)."""

    def __init__(self, options: TTFTPolicyOptions | None) -> None:
        """``options`` None (another policy): only the request counts are reported."""
        self.options = options
        self._lock = threading.Lock()
        self._ttfts: deque[tuple[float, float]] = deque()  # (monotonic time of the first token, TTFT s)

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if self.options is None or not iteration_stats.time_to_first_tokens_s:
            return
        with self._lock:
            for ttft in iteration_stats.time_to_first_tokens_s:
                self._ttfts.append((iteration_stats.now, ttft))
            self._forget_before(iteration_stats.now - self.options.ttft_window_s)  # bounded without reports

    def log(self) -> None:
        pass

    def report(self, running: int, waiting: int, now: float | None = None) -> dict[str, float]:
        """The custom autoscaling metrics (names above); ``now``: ``time.monotonic()`` unless given."""
        metrics = {RUNNING: float(running), WAITING: float(waiting)}
        if self.options is None:
            return metrics
        now = time.monotonic() if now is None else now
        with self._lock:
            self._forget_before(now - self.options.ttft_window_s)
            ttfts_ms = [ttft * 1000 for _, ttft in self._ttfts]
        metrics[TTFT_SAMPLES] = float(len(ttfts_ms))
        metrics[TTFT_SLOW] = float(sum(ttft > self.options.target_ttft_ms for ttft in ttfts_ms))
        metrics[TTFT_PERCENTILE_MS] = nearest_rank(ttfts_ms, self.options.ttft_percentile) if ttfts_ms else 0.0
        return metrics

    def _forget_before(self, cutoff: float) -> None:
        while self._ttfts and self._ttfts[0][0] < cutoff:
            self._ttfts.popleft()


@dataclass(frozen=True)
class ReplicaReport:
    """One replica's last report (``TTFTWindow.report``); a replica that has not reported yet counts as idle."""

    ttft_samples: int = 0
    ttft_slow: int = 0
    ttft_percentile_ms: float = 0.0
    running: int = 0
    waiting: int = 0

    @classmethod
    def from_metrics(cls, metrics: dict[str, float]) -> ReplicaReport:
        return cls(
            ttft_samples=int(metrics.get(TTFT_SAMPLES, 0)),
            ttft_slow=int(metrics.get(TTFT_SLOW, 0)),
            ttft_percentile_ms=float(metrics.get(TTFT_PERCENTILE_MS, 0.0)),
            running=int(metrics.get(RUNNING, 0)),
            waiting=int(metrics.get(WAITING, 0)),
        )


@dataclass(frozen=True)
class ScalingInputs:
    """What one decision looks at. ``target_replicas`` differs from ``current_replicas`` (running) while
    replicas start or stop; ``queued_at_handles`` and ``serve_ongoing`` are Serve's own counts (requests
    waiting in callers' handles; all requests in flight), averaged over its ``look_back_period_s``."""

    now: float
    current_replicas: int
    target_replicas: int
    min_replicas: int
    max_replicas: int
    reports: tuple[ReplicaReport, ...] = ()
    queued_at_handles: float = 0.0
    serve_ongoing: float = 0.0


@dataclass(frozen=True)
class ScalingDecision:
    num_replicas: int
    reason: str
    ttft_samples: int  # in every replica's window
    ttft_slow: int
    ttft_percentile_ms: float  # the largest replica percentile: a bound on the pooled one (never below it)
    waiting: float
    ongoing: float


def decide(
    options: TTFTPolicyOptions, inputs: ScalingInputs, state: dict[str, Any]
) -> tuple[ScalingDecision, dict[str, Any]]:
    """The replica count to ask for and the policy's new state (``state`` is not changed).

    Up by one while the TTFT percentile misses the target (with at least ``min_ttft_samples`` TTFTs, and
    not within ``ttft_window_s`` of the last change of the replica count: the window still holds TTFTs
    measured before it) or more requests wait than ``max_waiting_per_replica`` per replica. Down by one
    while neither holds, the objective is met and the requests in flight (running and waiting) fit on a
    replica fewer at ``idle_requests_per_replica`` each. Held while replicas start or stop (their effect is not measured
    yet). Always within ``[min_replicas, max_replicas]``.
    """
    state = _note_replica_changes(state, inputs)
    reports = inputs.reports
    samples = sum(r.ttft_samples for r in reports)
    slow = sum(r.ttft_slow for r in reports)
    waiting = sum(r.waiting for r in reports) + inputs.queued_at_handles
    ongoing = max(sum(r.running for r in reports) + waiting, inputs.serve_ongoing)
    missed = samples >= options.min_ttft_samples and percentile_exceeds(slow, samples, options.ttft_percentile)
    changed_at = state.get(_CHANGED_AT)
    settled = changed_at is None or inputs.now - changed_at >= options.ttft_window_s
    queue_grows = waiting > options.max_waiting_per_replica * max(inputs.current_replicas, 1)
    current = inputs.current_replicas
    if inputs.target_replicas != current:
        wanted, reason = inputs.target_replicas, "replicas starting or stopping"
    elif missed and settled:
        wanted, reason = current + 1, f"p{options.ttft_percentile:g} TTFT over {options.target_ttft_ms:g} ms"
    elif queue_grows:
        wanted, reason = current + 1, f"{waiting:g} requests waiting"
    elif not missed and ongoing <= options.idle_requests_per_replica * (current - 1):
        wanted, reason = current - 1, f"idle ({ongoing:g} requests in flight)"
    else:
        wanted, reason = current, "within the objective" if not missed else "TTFTs from before the last change"
    bounded = min(max(wanted, inputs.min_replicas), inputs.max_replicas)
    if bounded != wanted:
        reason += f" (bounded by {inputs.min_replicas}..{inputs.max_replicas})"
    percentile_ms = max((r.ttft_percentile_ms for r in reports if r.ttft_samples), default=0.0)
    return ScalingDecision(bounded, reason, samples, slow, percentile_ms, waiting, ongoing), state


def _note_replica_changes(state: dict[str, Any], inputs: ScalingInputs) -> dict[str, Any]:
    """``state`` with the running-replica count and when it last changed (never, at the first decision)."""
    state = dict(state)
    seen = state.get(_SEEN_REPLICAS)
    if seen is not None and seen != inputs.current_replicas:
        state[_CHANGED_AT] = inputs.now
    state[_SEEN_REPLICAS] = inputs.current_replicas
    return state


def inputs_from_context(ctx: Any) -> ScalingInputs:
    """``ScalingInputs`` from Serve's ``AutoscalingContext``: each running replica's latest report (the last
    point of its raw custom metrics: the replica already windows its TTFTs, Serve's averaging would blur them)."""
    latest: dict[Any, dict[str, float]] = {}
    for name, per_replica in (ctx.raw_metrics or {}).items():
        for replica_id, series in per_replica.items():
            if series:
                latest.setdefault(replica_id, {})[name] = max(series, key=lambda p: p.timestamp).value
    return ScalingInputs(
        now=ctx.current_time if ctx.current_time is not None else time.time(),
        current_replicas=ctx.current_num_replicas,
        target_replicas=ctx.target_num_replicas,
        min_replicas=ctx.capacity_adjusted_min_replicas,
        max_replicas=ctx.capacity_adjusted_max_replicas,
        reports=tuple(ReplicaReport.from_metrics(latest.get(r, {})) for r in ctx.running_replicas),
        queued_at_handles=float(ctx.total_queued_requests or 0.0),
        serve_ongoing=float(ctx.total_num_requests or 0.0),
    )


# The gauges the policy sets at each decision (``serval_autoscaling_<name>``, tagged by deployment): its inputs.
GAUGES = {
    "ttft_samples": "TTFTs in the replicas' windows.",
    "ttft_slow": "Of them, those over target_ttft_ms.",
    "ttft_percentile_ms": "The largest replica TTFT percentile (ms): the pooled one is never above it.",
    "waiting": "Requests waiting: the engines' queues plus Serve's handle queues.",
    "ongoing": "Requests in flight.",
    "num_replicas": "The replica count the policy asks for (before Serve's delays).",
}


class TTFTPolicy:
    """Serve's custom autoscaling policy for LLM-server deployments (``policy_function`` names this class;
    Serve makes one per deployment with its ``policy_kwargs``, then calls it with an ``AutoscalingContext``
    and gets the replica count to aim for and the policy state to hand back next time)."""

    def __init__(self, **policy_kwargs: Any) -> None:
        self.options = TTFTPolicyOptions.model_validate(policy_kwargs)
        self._last_wanted: int | None = None
        self._gauges: dict[str, Any] | None = None

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        decision, state = decide(self.options, inputs_from_context(ctx), ctx.policy_state)
        if decision.num_replicas != self._last_wanted and decision.num_replicas != ctx.target_num_replicas:
            logger.info(
                "TTFTPolicy %s: %d -> %d replicas: %s (%d TTFTs, %d over %g ms, replica p%g <= %.0f ms; %g waiting).",
                ctx.deployment_name,
                ctx.target_num_replicas,
                decision.num_replicas,
                decision.reason,
                decision.ttft_samples,
                decision.ttft_slow,
                self.options.target_ttft_ms,
                self.options.ttft_percentile,
                decision.ttft_percentile_ms,
                decision.waiting,
            )
        self._last_wanted = decision.num_replicas
        self._set_gauges(ctx, decision)
        return decision.num_replicas, state

    def _set_gauges(self, ctx: Any, decision: ScalingDecision) -> None:
        """In Serve's controller (a Ray actor); not where Ray is not running (unit tests)."""
        import ray
        from ray.util import metrics

        if not ray.is_initialized():
            return
        if self._gauges is None:
            self._gauges = {
                name: metrics.Gauge(f"serval_autoscaling_{name}", text, tag_keys=("deployment", "application"))
                for name, text in GAUGES.items()
            }
        tags = {"deployment": ctx.deployment_name, "application": ctx.app_name or ""}
        for name, gauge in self._gauges.items():
            gauge.set(float(getattr(decision, name)), tags=tags)
