"""The drivers of ``test_two_hosts``: each runs inside the head host (``TwoHostCluster.run_driver``),
joins the two-host Ray cluster and prints one ``RESULT {json}`` line that the test asserts on.

    python -m tests.cluster.two_host_driver pp CHECKPOINT
    python -m tests.cluster.two_host_driver serve CHECKPOINT
    python -m tests.cluster.two_host_driver node-loss RAYLET_PID

``pp``: the single-device greedy tokens, then those of a PP=2 ``LLM`` and the address of each stage's
node. ``serve``: deploys an app whose LLM server prefers the worker host (a label selector with a
fallback to the head host: a soft placement) behind an ingress on the head host, serves one completion
through the HTTP proxy on the head's loopback. ``node-loss``: streamed and plain completions in a loop
from a few clients while the worker host's raylet is SIGKILLed, until the replica runs again and a
while after; each request's fate and times.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from serval.launcher import lifecycle as launcher
from tests.cluster.netns import DASHBOARD_PORT, GCS_PORT, HEAD_ADDRESS, HOST_LABEL, HTTP_PORT, RESULT_PREFIX

MODEL_ID = "tiny"
SERVER_DEPLOYMENT = f"LLMServer:{MODEL_ID}"
SERVER_CLASS, INGRESS_CLASS = f"ServeReplica:llm:{SERVER_DEPLOYMENT}", "ServeReplica:llm:OpenAiIngress"  # actors
REQUEST_BOUND_S = 60.0  # a request with no answer after this long counts as hung
CLIENTS = 3
STREAM_TOKENS = 300  # about a second per request on this machine: several are in flight at the kill


def connect():
    import ray

    ray.init(address=f"{HEAD_ADDRESS}:{GCS_PORT}", _node_ip_address=HEAD_ADDRESS, logging_level="warning")
    deadline = time.monotonic() + 60
    while sum(node["Alive"] for node in ray.nodes()) < 2:
        assert time.monotonic() < deadline, "the worker host's node did not join"
        time.sleep(0.5)
    return ray


def node_addresses(ray) -> dict[str, str]:
    """node id -> address of every live node."""
    return {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}


def actor_addresses(ray, class_name: str) -> list[tuple[str, int]]:
    """(node address, pid) of each live actor of ``class_name``."""
    from ray.util.state import list_actors

    nodes = node_addresses(ray)
    actors = list_actors(
        address=launcher.dashboard_url(DASHBOARD_PORT),
        filters=[("state", "=", "ALIVE"), ("class_name", "=", class_name)],
    )
    return [(nodes.get(actor.node_id, "dead node"), actor.pid) for actor in actors]


def pipeline_parallel(checkpoint: str) -> dict:
    from engine import LLM
    from tests.cluster.test_ray_executor import ENGINE_KWARGS, _greedy_token_ids

    ray = connect()
    single = LLM(checkpoint, **ENGINE_KWARGS)
    try:
        expected = _greedy_token_ids(single)
    finally:
        single.shutdown()
    llm = LLM(
        checkpoint, pipeline_parallel_size=2, distributed_executor_backend="ray", num_cpus_per_worker=1, **ENGINE_KWARGS
    )
    try:
        node_ids = ray.get(
            [worker.node_id.remote() for worker in llm.llm_engine.engine_core.engine_core.executor.workers]
        )
        return {
            "expected": expected,
            "tokens": _greedy_token_ids(llm),
            "stage_addresses": [node_addresses(ray)[n] for n in node_ids],
        }
    finally:
        llm.shutdown()


def serve_config(checkpoint: str) -> dict:
    """One LLM server preferring the worker host (label selector, falling back to the head host), its
    ingress on the head host, the HTTP proxy on the head's loopback."""
    from tests.serve import cluster

    server = cluster.llm_config(MODEL_ID, checkpoint)
    server["deployment_config"].update(
        ray_actor_options={
            "num_cpus": 0.5,
            "label_selector": {HOST_LABEL: "h1"},
            "fallback_strategy": [{"label_selector": {HOST_LABEL: "h0"}}],
        },
        health_check_period_s=1.0,  # Serve notices a dead replica within a second or two
        graceful_shutdown_timeout_s=5,
    )
    config = cluster.serve_config(HTTP_PORT, [server])
    config["applications"][0]["args"]["ingress_deployment_config"] = {
        "ray_actor_options": {"num_cpus": 0.1, "label_selector": {HOST_LABEL: "h0"}}
    }
    return config


def client() -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{HTTP_PORT}/v1", api_key="unused", max_retries=0, timeout=REQUEST_BOUND_S
    )


def serve(checkpoint: str) -> dict:
    ray = connect()
    dashboard = launcher.dashboard_url(DASHBOARD_PORT)
    launcher.deploy(serve_config(checkpoint), dashboard)
    launcher.wait_until_running(dashboard, ["llm"], timeout_s=240)
    completion = client().completions.create(model=MODEL_ID, prompt="hello", max_tokens=8, temperature=0)
    return {
        "servers": actor_addresses(ray, SERVER_CLASS),
        "ingresses": actor_addresses(ray, INGRESS_CLASS),
        "completion_tokens": completion.usage.completion_tokens,
    }


def one_request(index: int, started: float) -> dict:
    """One completion, streamed on even ``index``: its fate ("ok", "error": an HTTP error or an error
    event, "cut": ended without a finish reason or error, "hung": nothing for REQUEST_BOUND_S) and times."""
    start = time.monotonic()
    fate, detail = "ok", ""
    try:
        kwargs = dict(model=MODEL_ID, prompt=f"request {index}", max_tokens=STREAM_TOKENS, temperature=0)
        kwargs["extra_body"] = {"ignore_eos": True}
        if index % 2:
            fate = "ok" if client().completions.create(**kwargs).usage.completion_tokens == STREAM_TOKENS else "cut"
        else:
            reasons = [
                c.choices[0].finish_reason for c in client().completions.create(**kwargs, stream=True) if c.choices
            ]
            fate = "ok" if reasons and reasons[-1] == "length" else "cut"
    except openai.APITimeoutError as error:
        fate, detail = "hung", str(error)
    except openai.APIStatusError as error:
        fate, detail = "error", f"{error.status_code}: {str(error)[:200]}"
    except openai.APIError as error:  # an error event in the stream (a closed connection is APIConnectionError)
        fate = "error" if error.body is not None else "cut"
        detail = f"{type(error).__name__}: {str(error)[:200]}"
    except httpx.TransportError as error:  # the connection closed mid-stream
        fate, detail = "cut", f"{type(error).__name__}: {str(error)[:200]}"
    return {"fate": fate, "start": start - started, "end": time.monotonic() - started, "detail": detail}


def server_status() -> tuple[str, list[str]]:
    """Serve's status of the LLM-server deployment and its replicas' states (the dashboard's REST API)."""
    status = launcher.serve_details(launcher.dashboard_url(DASHBOARD_PORT))
    deployment = status["applications"]["llm"]["deployments"][SERVER_DEPLOYMENT]
    return deployment["status"], [replica.get("state", "?") for replica in deployment.get("replicas", [])]


def wait_for_replacement(ray, deadline: float) -> None:
    """Until the worker host's node is dead, an LLM server's actor is alive on the head host and Serve calls
    the deployment HEALTHY with one RUNNING replica (UNHEALTHY on the way is expected, not final)."""
    while time.monotonic() < deadline:
        on_head = [address for address, _ in actor_addresses(ray, SERVER_CLASS)] == [HEAD_ADDRESS]
        if len(node_addresses(ray)) == 1 and on_head and server_status() == ("HEALTHY", ["RUNNING"]):
            return
        time.sleep(0.25)
    raise TimeoutError(f"no healthy LLM server replica on the head host: {server_status()}")


def node_loss(raylet_pid: int) -> dict:
    ray = connect()
    started, stop = time.monotonic(), threading.Event()
    outcomes: list[dict] = []
    counter = iter(range(10**6))

    def load() -> None:
        while not stop.is_set():
            outcomes.append(one_request(next(counter), started))

    with ThreadPoolExecutor(CLIENTS) as pool:
        clients = [pool.submit(load) for _ in range(CLIENTS)]
        time.sleep(2.0)
        os.kill(raylet_pid, signal.SIGKILL)
        killed = time.monotonic() - started
        try:
            wait_for_replacement(ray, time.monotonic() + 120)
        finally:
            replaced = time.monotonic() - started
            time.sleep(3.0)  # load on the new replica
            stop.set()
    for finished in clients:
        finished.result()  # a client that raised something unclassified fails the driver
    after = one_request(1, started)
    return {
        "killed": killed,
        "replaced": replaced,
        "outcomes": outcomes,
        "after": after,
        "servers": actor_addresses(ray, SERVER_CLASS),
    }


def main(argv: list[str]) -> None:
    scenario, argument = argv
    if scenario == "pp":
        result = pipeline_parallel(argument)
    elif scenario == "serve":
        result = serve(argument)
    else:
        result = node_loss(int(argument))
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
