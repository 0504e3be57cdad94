"""Changing the replica count of a running app, the ways a user does it, with streams in flight.

1 -> 2 through the dashboard's REST API (PUT /api/serve/applications/, what
``serve deploy`` sends) with Serve's per-deployment override; 2 -> 1 through
Serve's external-scaler endpoint; 1 -> 2 by editing the builder's args. In
each case every stream that was in flight completes (``[DONE]`` and its full
token count), and after a scale-up both replicas serve traffic. The streams
in flight at 2 -> 1 run for seconds past the stopping replica's drain window: it lets
them finish within its ``graceful_shutdown_timeout_s`` before its engine stops.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest
from ray import serve

from serval.launcher import lifecycle as launcher
from serval.launcher import serve_client
from tests.serve.cluster import (
    RayHead,
    Replica,
    app_status,
    deploy_and_wait,
    llm_config,
    replica_loads,
    running_replicas,
    serve_config,
    sse_lines,
)
from tests.serve.haproxy_log import HAProxyLog

LLAMA = "tiny-llama"
SERVER = f"LLMServer:{LLAMA}"
STREAM_TOKENS = 250
# Seconds of streaming (max_model_len is 2048): past the drain window, inside graceful_shutdown_timeout_s.
LONG_STREAM_TOKENS = 1900


def replica_states(head) -> tuple[str, list[str]]:
    """The app's status and its LLM server's replica states (the deployment may be briefly unlisted
    while an update is being applied)."""
    status = app_status(head)
    replicas = status.get("deployments", {}).get(SERVER, {}).get("replicas", [])
    return status["status"], [replica["state"] for replica in replicas]


def wait_for_replicas(head, count: int, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (states := replica_states(head)) != ("RUNNING", ["RUNNING"] * count):
        assert time.monotonic() < deadline, f"not {count} running replicas: {states}"
        time.sleep(0.5)


def stream_completion(
    base_url: str, started: threading.Event, tokens: int, haproxy_log: HAProxyLog | None = None
) -> tuple[int, str | None, bool]:
    """One streamed completion; sets ``started`` at its first token; returns (tokens, finish_reason, done).
    A cut line, or an end without ``[DONE]``, fails with what HAProxy logged of this connection."""
    finish_reason, num_tokens, done = None, None, False
    with httpx.Client(timeout=300) as http:
        with http.stream(
            "POST",
            f"{base_url}/v1/completions",
            json={
                "model": LLAMA,
                "prompt": "Once upon a time",
                "max_tokens": tokens,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as response:
            assert response.status_code == 200
            client_port = response.extensions["network_stream"].get_extra_info("client_addr")[1]

            def what_haproxy_saw() -> list[str]:
                return haproxy_log.about(client_port) if haproxy_log is not None else []

            previous = ""
            for line in sse_lines(response):
                done = done or line == "data: [DONE]"
                if not line.startswith("data: {"):
                    continue
                started.set()
                try:
                    chunk = json.loads(line.removeprefix("data: "))
                except ValueError:  # what came before and with it, to tell a cut from a malformed event
                    raise AssertionError(
                        f"a cut SSE line {line!r} after {previous!r}; {response.headers}; HAProxy: {what_haproxy_saw()}"
                    ) from None
                previous = line
                if chunk.get("choices"):
                    finish_reason = chunk["choices"][0]["finish_reason"] or finish_reason
                if chunk.get("usage"):
                    num_tokens = chunk["usage"]["completion_tokens"]
            if not done:
                raise AssertionError(f"a stream ended without [DONE] after {previous!r}; HAProxy: {what_haproxy_saw()}")
    return num_tokens, finish_reason, done


class InFlightStreams:
    """Starts ``count`` streams (``add`` starts more) and waits until each has produced a token."""

    def __init__(self, pool: ThreadPoolExecutor, head: RayHead, count: int, tokens: int = STREAM_TOKENS) -> None:
        self.pool, self.head, self.tokens = pool, head, tokens
        self.futures: list[Future] = []
        self.add(count)

    def add(self, count: int) -> None:
        events = [threading.Event() for _ in range(count)]
        futures = [
            self.pool.submit(stream_completion, self.head.base_url, event, self.tokens, self.head.haproxy_log)
            for event in events
        ]
        self.futures += futures
        for event, future in zip(events, futures):
            while not event.wait(0.1):
                if future.done():
                    future.result()  # re-raises what went wrong
                    raise AssertionError("a stream finished before its first token")

    def assert_all_complete(self) -> None:
        results = [future.result(timeout=300) for future in self.futures]
        assert results == [(self.tokens, "length", True)] * len(self.futures)

    def spread_over(self, replicas: list[Replica], max_streams: int = 16) -> dict[str, int]:
        """Adds streams one at a time until every replica's engine holds one (asked of each replica, not
        through Serve's router); returns the requests each holds."""
        while True:
            loads = {rid: load["num_running"] + load["num_waiting"] for rid, load in replica_loads(replicas).items()}
            if all(loads.values()) or len(self.futures) >= max_streams:
                return loads
            self.add(1)


def replica_stats(num_calls: int = 40) -> dict[str, dict]:
    """Stats per replica id, gathered by calling the deployment often enough to reach every replica."""
    handle = serve.get_deployment_handle(SERVER, app_name="llm")
    stats = {}
    for _ in range(num_calls):
        result = handle.stats.remote().result()
        stats[result["replica_id"]] = result
    return stats


def assert_every_replica_serves(base_url: str, pool: ThreadPoolExecutor, num_replicas: int) -> None:
    before = {rid: s["num_finished_reqs_total"] for rid, s in replica_stats().items()}

    def complete(i: int) -> int:
        response = httpx.post(
            f"{base_url}/v1/completions",
            timeout=120,
            json={"model": LLAMA, "prompt": f"Request {i}", "max_tokens": 48, "ignore_eos": True},
        )
        return response.status_code

    assert list(pool.map(complete, range(32))) == [200] * 32
    after = replica_stats()
    assert len(after) == num_replicas
    served = {rid: s["num_finished_reqs_total"] - before.get(rid, 0) for rid, s in after.items()}
    assert all(count > 0 for count in served.values()), served


@pytest.fixture(scope="module")
def config(ray_head, tiny_checkpoint):
    return serve_config(ray_head.http_port, [llm_config(LLAMA, tiny_checkpoint("llama"), max_model_len=2048)])


def test_an_unknown_key_fails_the_deploy_with_its_name(ray_head, config):
    """Deployed as ``serve deploy`` does (the builder runs in Serve): the app's DEPLOY_FAILED message is Serve's
    header and the builder's one line (deployments/config_errors.py), no traceback, and the launcher (what
    ``serval serve`` and ``serval status`` print) shows that line whole."""
    bad = copy.deepcopy(config)
    bad["applications"][0]["args"]["llm_configs"][0]["engine_kwargs"]["max_num_seqz"] = 4
    launcher.deploy(bad, ray_head.dashboard_url)
    with pytest.raises(RuntimeError, match="max_num_seqz") as failed:
        launcher.wait_until_running(ray_head.dashboard_url, ["llm"], timeout_s=120)
    line = "args.llm_configs[0].engine_kwargs.max_num_seqz: unknown key; did you mean max_num_seqs?"
    app = serve_client.instance_details(ray_head.dashboard_url).applications["llm"]
    assert app.status == "DEPLOY_FAILED"
    assert app.message.splitlines() == ["Deploying app 'llm' failed with exception:", line]
    assert line in str(failed.value), str(failed.value)


def test_scale_up_and_down_keeps_streams_in_flight(ray_head, config):
    base_url = ray_head.base_url
    deploy_and_wait(ray_head, config)
    wait_for_replicas(ray_head, 1)
    with ThreadPoolExecutor(max_workers=16) as pool:
        # 1 -> 2 through the dashboard's REST API: Serve's per-deployment override, a light update.
        streams = InFlightStreams(pool, ray_head, 6)
        scaled = copy.deepcopy(config)
        scaled["applications"][0]["deployments"] = [{"name": SERVER, "num_replicas": 2}]
        launcher.deploy(scaled, ray_head.dashboard_url)
        wait_for_replicas(ray_head, 2)
        streams.assert_all_complete()
        assert_every_replica_serves(base_url, pool, 2)

        # 2 -> 1 through Serve's external-scaler endpoint; the stopping replica drains its streams, long ones
        # (seconds past its drain window) included: both replicas hold some, so whichever stops has them.
        scaled["applications"][0]["external_scaler_enabled"] = True
        launcher.deploy(scaled, ray_head.dashboard_url)
        streams = InFlightStreams(pool, ray_head, 6, LONG_STREAM_TOKENS)
        held = streams.spread_over(running_replicas(ray_head, SERVER))
        assert len(held) == 2 and all(held.values()), held
        url = f"{ray_head.dashboard_url}/api/v1/applications/llm/deployments/{SERVER}/scale"
        headers = {"Authorization": f"Bearer {launcher.ray_auth_token()}"}  # the cluster uses token auth
        assert httpx.post(url, json={"target_num_replicas": 1}, headers=headers, timeout=30).status_code == 200
        wait_for_replicas(ray_head, 1)
        streams.assert_all_complete()

        # 1 -> 2 by editing num_replicas in the builder's args: Serve redeploys the app, old replicas drain.
        streams = InFlightStreams(pool, ray_head, 4)
        edited = copy.deepcopy(config)
        edited["applications"][0]["args"]["llm_configs"][0]["deployment_config"]["num_replicas"] = 2
        launcher.deploy(edited, ray_head.dashboard_url)
        wait_for_replicas(ray_head, 2)
        streams.assert_all_complete()
        assert_every_replica_serves(base_url, pool, 2)


def test_scale_up_of_a_direct_ingress_app_keeps_streams_in_flight(ray_head, config):
    """``separate_ingress: false``: the LLM servers are HAProxy's backends themselves, so every change of their
    count reloads HAProxy (a new process; the old one is soft-stopped with its sessions). Streams started the
    moment the app is RUNNING may still go through Serve's fallback proxy (HAProxy is given the replica a
    moment later, by a reload); the 1 -> 2 scale-up reloads again while they stream. Every one completes."""
    direct = copy.deepcopy(config)
    direct["applications"][0]["args"]["separate_ingress"] = False
    deploy_and_wait(ray_head, direct)
    wait_for_replicas(ray_head, 1)
    with ThreadPoolExecutor(max_workers=8) as pool:
        streams = InFlightStreams(pool, ray_head, 6, LONG_STREAM_TOKENS)
        scaled = copy.deepcopy(direct)
        scaled["applications"][0]["deployments"] = [{"name": SERVER, "num_replicas": 2}]
        launcher.deploy(scaled, ray_head.dashboard_url)
        wait_for_replicas(ray_head, 2)
        streams.assert_all_complete()
        assert_every_replica_serves(ray_head.base_url, pool, 2)
