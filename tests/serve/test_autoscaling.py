"""TTFTPolicy (deployments/autoscaling.py) on a real cluster: one tiny-llama replica behind the ingress, a load
ramp of streamed completions makes the policy add a second replica within ``UPSCALE_BUDGET_S``, a trickle
afterwards (two longer streams at a time, so as a rule one on each replica) lets it remove that replica again
within ``DOWNSCALE_BUDGET_S``, and every stream on the way ends with its full token count and ``[DONE]`` (the
replica scaled down drains its stream).

Only the TTFT objective can scale up here: ``max_waiting_per_replica`` is out of reach. With two sequences
per engine step (``max_num_seqs``), sixteen concurrent 128-token streams queue up to seven rounds of 128 steps
deep, and the queued ones' TTFTs miss the 200 ms target on any machine whose engine step takes over 0.3 ms
(a CI machine twice this one's speed kept the p90 of twelve 64-token streams under 300 ms); two at a time
do not.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest

from deployments.autoscaling import GAUGES, TTFT_POLICY
from tests.serve.cluster import app_status, deploy_and_wait, llm_config, serve_config, sse_lines

# ~80 s alone on the shared 2-core machine (the head and two replica starts are most of it).
pytestmark = pytest.mark.slow

LLAMA = "tiny-llama"
SERVER = f"LLMServer:{LLAMA}"
STREAM_TOKENS = 128
TRICKLE_TOKENS = 256
RAMP_STREAMS = 16
TRICKLE_STREAMS = 2
UPSCALE_BUDGET_S = 60.0  # ramp start -> second replica RUNNING (its start is most of it)
DOWNSCALE_BUDGET_S = 45.0  # ramp end -> one replica (a TTFT window, the downscale delay, the drain)
AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "upscale_delay_s": 1.0,
    "downscale_delay_s": 3.0,
    "metrics_interval_s": 0.5,
    "look_back_period_s": 2.0,
    "policy": {
        "policy_function": TTFT_POLICY,
        "policy_kwargs": {
            "target_ttft_ms": 200,
            "ttft_window_s": 4,
            "min_ttft_samples": 4,
            "max_waiting_per_replica": 1000,
            "idle_requests_per_replica": TRICKLE_STREAMS,
        },
    },
}


@pytest.fixture(scope="module")
def app(ray_head, tiny_checkpoint):
    config = llm_config(LLAMA, tiny_checkpoint("llama"), max_num_seqs=2)
    deployment = config["deployment_config"]
    del deployment["num_replicas"]
    deployment["autoscaling_config"] = AUTOSCALING
    deployment["ray_actor_options"] = {"num_cpus": 0.5}  # two replicas and the ingress fit on 2 CPUs
    deploy_and_wait(ray_head, serve_config(ray_head.http_port, [config]))
    return ray_head


def running_replicas(head) -> int:
    replicas = app_status(head).get("deployments", {}).get(SERVER, {}).get("replicas", [])
    return sum(replica["state"] == "RUNNING" for replica in replicas)


def wait_for_replicas(head, count: int, budget_s: float, since: float) -> float:
    """Seconds from ``since`` until exactly ``count`` replicas run (and no other is starting or stopping)."""
    while True:
        replicas = app_status(head).get("deployments", {}).get(SERVER, {}).get("replicas", [])
        if [r["state"] for r in replicas] == ["RUNNING"] * count:
            return time.monotonic() - since
        if time.monotonic() - since >= budget_s:
            pytest.fail(f"not {count} running replicas: {replicas}; the policy's gauges: {policy_gauges(head)}")
        time.sleep(0.25)


def stream_completion(base_url: str, index: int, max_tokens: int) -> tuple[int | None, str | None, bool]:
    """One streamed completion: (completion tokens from its usage, finish reason, whether [DONE] came)."""
    body = {
        "model": LLAMA,
        "prompt": f"Stream {index} once upon a time",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens, finish_reason, done = None, None, False
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in sse_lines(response):
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                if chunk.get("choices"):
                    finish_reason = chunk["choices"][0]["finish_reason"] or finish_reason
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return tokens, finish_reason, done


def stream_until(base_url: str, stop: threading.Event, worker: int, max_tokens: int) -> list[tuple]:
    """Streams one completion after another until ``stop`` is set (the one in flight finishes)."""
    results = []
    while not stop.is_set():
        results.append(stream_completion(base_url, worker * 1000 + len(results), max_tokens))
    return results


def test_a_load_ramp_adds_a_replica_and_idling_removes_it_without_cutting_a_stream(app):
    base_url = app.base_url
    assert running_replicas(app) == 1
    ramp_stop, trickle_stop = threading.Event(), threading.Event()
    with ThreadPoolExecutor(max_workers=RAMP_STREAMS + TRICKLE_STREAMS) as pool:
        try:  # whatever fails, every stream loop stops: the pool's exit waits for them
            started = time.monotonic()
            ramp: list[Future] = [
                pool.submit(stream_until, base_url, ramp_stop, i, STREAM_TOKENS) for i in range(RAMP_STREAMS)
            ]
            upscale_s = wait_for_replicas(app, 2, UPSCALE_BUDGET_S, started)
            time.sleep(2.0)  # streams reach the new replica
            ramp_stop.set()
            trickle = [
                pool.submit(stream_until, base_url, trickle_stop, RAMP_STREAMS + i, TRICKLE_TOKENS)
                for i in range(TRICKLE_STREAMS)
            ]
            ramp_results = [result for future in ramp for result in future.result(timeout=120)]
            ramp_ended = time.monotonic()
            downscale_s = wait_for_replicas(app, 1, DOWNSCALE_BUDGET_S, ramp_ended)
            trickle_stop.set()
            trickle_results = [result for future in trickle for result in future.result(timeout=120)]
        finally:
            ramp_stop.set()
            trickle_stop.set()
    print(f"upscale after {upscale_s:.1f} s of ramp, downscale {downscale_s:.1f} s after it")
    print(f"{len(ramp_results)} ramp streams, {len(trickle_results)} trickle streams")
    assert len(ramp_results) > RAMP_STREAMS and len(trickle_results) > TRICKLE_STREAMS
    assert ramp_results == [(STREAM_TOKENS, "length", True)] * len(ramp_results)
    assert trickle_results == [(TRICKLE_TOKENS, "length", True)] * len(trickle_results)
    assert_policy_gauges(app)


def policy_gauges(head) -> list[str]:
    """The policy's ``serval_autoscaling_*`` gauge lines on the node's Prometheus endpoint."""
    text = httpx.get(f"http://127.0.0.1:{head.metrics_port}/metrics", timeout=10).text
    return [line for line in text.splitlines() if line.startswith("ray_serval_autoscaling_")]


def assert_policy_gauges(head) -> None:
    """The policy's inputs reach the node's Prometheus endpoint (the controller's gauges): it asks for one
    replica now, has seen TTFTs, and every series the dashboard's autoscaling row reads is there."""
    from serval.dashboard import load_dashboard

    exprs = json.dumps(load_dashboard())
    dashboard_series = set(re.findall(r"ray_serval_autoscaling_\w+", exprs))
    assert len(dashboard_series) == len(GAUGES), dashboard_series
    deadline = time.monotonic() + 30
    while True:
        gauges = policy_gauges(head)
        wanted = [line for line in gauges if line.startswith("ray_serval_autoscaling_num_replicas{") and SERVER in line]
        exported = {line.split("{")[0] for line in gauges}
        if wanted and wanted[0].endswith(" 1.0") and dashboard_series <= exported:
            return
        assert time.monotonic() < deadline, gauges or "no serval_autoscaling gauges"
        time.sleep(1)
