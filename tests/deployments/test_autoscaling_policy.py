"""TTFTPolicy (deployments/autoscaling.py) on plain data: when it scales up, down or holds, the replica's TTFT
window, the exact deployment-wide percentile verdict, its glue to Serve's real ``AutoscalingContext`` and
``AutoscalingConfig`` (no cluster), and the deploy-time checks of its options (deployments/llm_config.py)."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from deployments.autoscaling import (
    TTFT_POLICY,
    ReplicaReport,
    ScalingInputs,
    TTFTPolicy,
    TTFTPolicyOptions,
    TTFTWindow,
    decide,
    nearest_rank,
    percentile_exceeds,
)
from deployments.llm_config import LLMConfig, LLMServingArgs
from engine.metrics.stats import IterationStats

OPTIONS = TTFTPolicyOptions(target_ttft_ms=500, ttft_window_s=10, min_ttft_samples=4, max_waiting_per_replica=2)


def report(samples=0, slow=0, running=0, waiting=0, percentile_ms=0.0) -> ReplicaReport:
    return ReplicaReport(samples, slow, percentile_ms, running, waiting)


def inputs(*reports: ReplicaReport, current=1, target=None, lo=1, hi=3, now=100.0, **serve) -> ScalingInputs:
    target = current if target is None else target
    return ScalingInputs(now, current, target, lo, hi, reports, **serve)


def wanted(scaling_inputs: ScalingInputs, state=None, options=OPTIONS) -> int:
    return decide(options, scaling_inputs, state or {})[0].num_replicas


def test_a_missed_ttft_percentile_adds_one_replica():
    decision, _ = decide(OPTIONS, inputs(report(samples=10, slow=2, running=3, percentile_ms=900)), {})
    assert decision.num_replicas == 2 and "p90 TTFT over 500 ms" in decision.reason
    assert (decision.ttft_samples, decision.ttft_slow, decision.ttft_percentile_ms) == (10, 2, 900)


def test_the_verdict_pools_the_replicas_counts():
    # Replica 1 alone misses p90 (2 of 10 slow); pooled with replica 2's 30 fast TTFTs, p90 holds.
    assert wanted(inputs(report(samples=10, slow=2, running=2), report(samples=30, running=2), current=2)) == 2
    assert wanted(inputs(report(samples=10, slow=2), report(samples=30, slow=3), current=2)) == 3


def test_too_few_ttfts_give_no_verdict():
    assert wanted(inputs(report(samples=3, slow=3, running=1))) == 1


def test_a_growing_queue_adds_a_replica_whatever_the_ttfts():
    assert wanted(inputs(report(running=8, waiting=3))) == 2
    assert wanted(inputs(report(running=8, waiting=1), queued_at_handles=2.0)) == 2  # Serve's handle queues count
    assert wanted(inputs(report(running=8, waiting=2))) == 1  # at the threshold: hold


def test_idle_removes_one_replica_at_a_time_down_to_min():
    assert wanted(inputs(report(), report(), report(), current=3)) == 2
    assert wanted(inputs(report(running=1), report(), current=2)) == 1  # 1 request fits on one replica
    assert wanted(inputs(report(running=2), report(), current=2)) == 2
    assert (
        wanted(inputs(report(), report(), current=2), options=OPTIONS.model_copy(update={"min_ttft_samples": 1})) == 1
    )
    assert wanted(inputs(report(), current=1)) == 1  # min_replicas
    # Serve's count of requests in flight (averaged over its look-back) keeps a replica that reports nothing yet.
    assert wanted(inputs(report(), report(), current=2, serve_ongoing=3.0)) == 2


def test_no_scale_down_while_the_objective_is_missed():
    assert wanted(inputs(report(samples=10, slow=5), report(), current=2, hi=2)) == 2


def test_bounds_hold_whatever_the_signals():
    assert wanted(inputs(report(samples=10, slow=10, waiting=50), current=3, hi=3)) == 3
    decision, _ = decide(OPTIONS, inputs(report(), current=1, lo=2), {})
    assert decision.num_replicas == 2 and "bounded" in decision.reason


def test_replicas_starting_or_stopping_hold_the_target():
    assert wanted(inputs(report(samples=10, slow=10, waiting=50), current=1, target=2)) == 2
    assert wanted(inputs(report(), report(), current=2, target=1)) == 1


def test_ttfts_from_before_a_replica_change_are_not_acted_on_for_one_window():
    slow = report(samples=10, slow=5)
    _, state = decide(OPTIONS, inputs(slow, now=0.0), {})
    decision, state = decide(OPTIONS, inputs(slow, current=2, target=2, now=5.0), state)  # the new replica runs
    assert decision.num_replicas == 2 and "before the last change" in decision.reason
    assert wanted(inputs(slow, report(), current=2, now=14.9), state) == 2
    assert wanted(inputs(slow, report(), current=2, now=15.0), state) == 3  # a full window later
    # The waiting queue is measured now, not over a window: it is acted on at once.
    assert wanted(inputs(report(waiting=9), report(), current=2, now=6.0), state) == 3


def test_decide_leaves_the_callers_state_alone():
    state = {"serve_internal": 1}
    _, new_state = decide(OPTIONS, inputs(report()), state)
    assert state == {"serve_internal": 1} and new_state["serve_internal"] == 1


@pytest.mark.parametrize("seed", range(20))
def test_the_pooled_verdict_is_the_nearest_rank_percentile_of_all_ttfts(seed):
    rng = random.Random(seed)
    ttfts = [[rng.expovariate(1 / 400) for _ in range(rng.randint(1, 40))] for _ in range(rng.randint(1, 4))]
    pooled = [t for replica in ttfts for t in replica]
    slow = sum(t > 500 for t in pooled)
    for percentile in (50, 90, 99):
        assert percentile_exceeds(slow, len(pooled), percentile) == (nearest_rank(pooled, percentile) > 500)
        # The largest replica percentile bounds the pooled one from above.
        assert max(nearest_rank(r, percentile) for r in ttfts) >= nearest_rank(pooled, percentile)


def step(now: float, *ttfts_s: float) -> IterationStats:
    return IterationStats(now=now, time_to_first_tokens_s=list(ttfts_s))


def test_the_replica_window_keeps_its_last_seconds_of_ttfts():
    window = TTFTWindow(OPTIONS)
    window.record(None, step(0.0, 0.9))
    window.record(None, step(5.0, 0.1, 0.2, 0.6))
    window.record(None, step(6.0))
    assert window.report(running=3, waiting=1, now=9.0) == {
        "serval_running_requests": 3.0,
        "serval_waiting_requests": 1.0,
        "serval_ttft_samples": 4.0,
        "serval_ttft_slow": 2.0,
        "serval_ttft_percentile_ms": 900.0,
    }
    report_later = window.report(running=0, waiting=0, now=12.0)  # the 0.9 s TTFT left the window
    assert (report_later["serval_ttft_samples"], report_later["serval_ttft_slow"]) == (3.0, 1.0)
    assert report_later["serval_ttft_percentile_ms"] == pytest.approx(600.0)
    assert window.report(0, 0, now=30.0)["serval_ttft_samples"] == 0.0


def test_the_window_stays_bounded_between_reports():
    window = TTFTWindow(OPTIONS)
    for second in range(1000):
        window.record(None, step(float(second), 0.1, 0.2))
    assert len(window._ttfts) == 2 * 11  # the last 10 s, both ends included
    assert window.report(0, 0, now=999.0)["serval_ttft_samples"] == 22.0


def test_without_the_policy_the_replica_reports_only_its_queues():
    window = TTFTWindow(None)
    window.record(None, step(0.0, 0.9))
    assert window.report(running=2, waiting=0, now=1.0) == {
        "serval_running_requests": 2.0,
        "serval_waiting_requests": 0.0,
    }


def test_the_policy_reads_serves_autoscaling_context():
    from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    deployment = DeploymentID("LLMServer:m", "llm")
    replicas = [ReplicaID("a", deployment), ReplicaID("b", deployment)]
    raw = {  # the last point of each series is what counts: older ones were reported before
        "serval_ttft_samples": {replicas[0]: [TimeStampedValue(2.0, 10), TimeStampedValue(1.0, 99)]},
        "serval_ttft_slow": {replicas[0]: [TimeStampedValue(1.0, 0), TimeStampedValue(2.0, 4)]},
        "serval_waiting_requests": {replicas[1]: [TimeStampedValue(2.0, 1)]},
    }
    policy = TTFTPolicy(target_ttft_ms=500, max_waiting_per_replica=8)
    ctx = AutoscalingContext(
        deployment_id=deployment,
        deployment_name=deployment.name,
        app_name="llm",
        current_num_replicas=2,
        target_num_replicas=2,
        running_replicas=replicas,
        total_num_requests=lambda: 6.0,
        total_queued_requests=lambda: 0.0,
        aggregated_metrics=None,
        raw_metrics=lambda: raw,
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=4,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=1000.0,
        config=AutoscalingConfig(min_replicas=1, max_replicas=4),
    )
    num_replicas, state = policy(ctx)
    assert num_replicas == 3 and state["serval_seen_replicas"] == 2


def llm_config(autoscaling: dict, **engine_kwargs) -> dict:
    return {
        "model_loading_config": {"model_id": "m", "model_source": "models/tiny-llama"},
        "engine_kwargs": engine_kwargs,
        "deployment_config": {"autoscaling_config": autoscaling},
    }


def ttft_autoscaling(**policy_kwargs) -> dict:
    policy = {"policy_function": TTFT_POLICY, "policy_kwargs": policy_kwargs}
    return {"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 1, "policy": policy}


def test_the_yaml_reaches_serve_which_builds_the_policy_with_its_options():
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.config import AutoscalingConfig

    config = LLMConfig.model_validate(llm_config(ttft_autoscaling(target_ttft_ms=250, ttft_window_s=5)))
    assert config.deployment_config.ttft_policy_options() == TTFTPolicyOptions(target_ttft_ms=250, ttft_window_s=5)
    serve_config = AutoscalingConfig(**config.deployment_config.to_options()["autoscaling_config"])
    policy = _resolve_policy_callable(serve_config.policy)
    assert isinstance(policy, TTFTPolicy) and policy.options.target_ttft_ms == 250


@pytest.mark.parametrize(
    "policy_kwargs, message",
    [
        ({}, "target_ttft_ms"),
        ({"target_ttft_ms": 0}, "target_ttft_ms"),
        ({"target_ttft_ms": -5}, "target_ttft_ms"),
        ({"target_ttft_ms": 500, "target_ttft": 1}, "target_ttft"),
        ({"target_ttft_ms": 500, "ttft_percentile": 100}, "ttft_percentile"),
        ({"target_ttft_ms": 500, "ttft_window_s": 0}, "ttft_window_s"),
        ({"target_ttft_ms": 500, "min_ttft_samples": 0}, "min_ttft_samples"),
    ],
)
def test_bad_policy_options_fail_the_deploy_with_their_name(policy_kwargs, message):
    # At the key's own path (deployments/config_errors.py makes it the one line a refused deploy shows).
    with pytest.raises(
        ValidationError, match=rf"deployment_config\.autoscaling_config\.policy\.policy_kwargs\.{message}\n"
    ):
        LLMConfig.model_validate(llm_config(ttft_autoscaling(**policy_kwargs)))


def test_the_policy_needs_the_engines_ttfts():
    with pytest.raises(ValidationError, match="disable_log_stats"):
        LLMConfig.model_validate(llm_config(ttft_autoscaling(target_ttft_ms=500), disable_log_stats=True))


def test_the_policy_scales_llm_servers_not_the_ingress():
    args = {"llm_configs": [llm_config({"min_replicas": 1, "max_replicas": 2})]}
    with pytest.raises(ValidationError, match="not the ingress"):
        LLMServingArgs.model_validate(
            {**args, "ingress_deployment_config": {"autoscaling_config": ttft_autoscaling(target_ttft_ms=500)}}
        )


def test_other_policies_options_are_theirs_to_check():
    policy = {
        "policy_function": "ray.serve.autoscaling_policy:default_autoscaling_policy",
        "policy_kwargs": {"anything": 1},
    }
    config = LLMConfig.model_validate(llm_config({"max_replicas": 2, "policy": policy}))
    assert config.deployment_config.ttft_policy_options() is None
    with pytest.raises(ValidationError, match="policy_functoin"):
        LLMConfig.model_validate(llm_config({"policy": {"policy_functoin": TTFT_POLICY}}))
