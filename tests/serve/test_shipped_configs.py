"""Every shipped CPU config runs where the README says it runs: a 2-CPU Ray head on loopback, started as
`make serve` starts it. Each ``configs/serve/*.yaml`` that is not a GPU example (``gpu-*`` or any
``num_gpus``) fits the head as shipped (the launcher's check, which counts every replica), is deployed with
its model pointed at a local tiny checkpoint and at one replica a deployment (kv_routing.yaml ships two: the
check counts the second, and starting a copy of the first would cost an engine start), becomes RUNNING and
answers one completion per app; then the launcher's stop (`make stop`) lets a stream in flight finish and
leaves none of the head's processes behind. What the PD app of pd.yaml does (KV moved, outputs equal, blocks
freed) is proved by tests/serve/test_pd_serve.py; here, that the shipped file runs.

One head for the module; the configs replace each other's app (Serve's deploy is declarative; each app is
named after its file, so that the one before is deleted as the next one builds).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from serval.launcher import lifecycle as launcher
from serval.launcher import processes as ray_processes
from serval.launcher import status as launcher_status
from tests.helm.local_head import start_head
from tests.serve.cluster import sse_lines

pytestmark = [pytest.mark.ray, pytest.mark.serve, pytest.mark.slow]

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "serve"
# The model sources the shipped configs name: the default (`make models`), the trained pair, the tiny one.
SHIPPED_MODELS = ("models/smollm2-135m-instruct", "assets/trained/serval-llama-10m", "models/tiny-llama")
SHIPPED_DRAFT = "assets/trained/serval-llama-draft"  # configs/serve/spec_decode.yaml's speculative_config.model
NUM_CPUS = 2  # the machine the README runs them on
STOP_BUDGET_S = 10.0  # `make stop` with nothing left in flight (issue 17)


def cpu_configs() -> list[str]:
    return sorted(
        path.name
        for path in CONFIGS.glob("*.yaml")
        if not path.name.startswith("gpu-") and "num_gpus" not in path.read_text()
    )


def localized(name: str, http_port: int, checkpoint: str) -> dict:
    """The shipped config with its HTTP port on this test's head and its model (one of ``SHIPPED_MODELS``)
    at ``checkpoint``."""
    text = (CONFIGS / name).read_text()
    assert any(model in text for model in SHIPPED_MODELS), f"{name} serves none of {SHIPPED_MODELS}: update this test"
    for model in SHIPPED_MODELS:
        text = text.replace(f"model_source: {model}", f"model_source: {checkpoint}")
    text = text.replace(f"model: {SHIPPED_DRAFT}", f"model: {checkpoint}")  # a draft shares the target's vocabulary
    config = yaml.safe_load(text)
    config["http_options"]["port"] = http_port
    return config


def as_deployed(config: dict, name: str) -> dict:
    """``config`` with each LLM server's fixed ``num_replicas`` above one cut to one (autoscaled ones start at
    their min_replicas, 1 in every shipped config), and each app named after the file too (``llm`` ->
    ``llm-pd``): Serve deletes the app of the config before as the deploy arrives, so its replicas stop while
    this one builds, instead of after."""
    for app in config["applications"]:
        app["name"] = f"{app['name']}-{Path(name).stem}"
        args = app["args"]
        for llm_config in args.get("llm_configs") or [args["prefill_config"], args["decode_config"]]:
            deployment = llm_config.get("deployment_config", {})
            if deployment.get("num_replicas", 1) > 1:
                deployment["num_replicas"] = 1
    return config


def served_model_ids(app: dict) -> set[str]:
    args = app["args"]
    configs = args.get("llm_configs") or [args["decode_config"]]
    return {c["model_loading_config"]["model_id"] for c in configs}


@pytest.fixture(scope="module")
def head():
    started = start_head(num_cpus=NUM_CPUS)
    try:
        yield started
    finally:
        launcher.stop_cluster(started.dashboard_port, started.gcs_port, drain_timeout_s=10)


def test_the_cpu_configs_are_found():
    assert {"default.yaml", "pd.yaml"} <= set(cpu_configs())


@pytest.mark.parametrize("name", cpu_configs())
def test_a_shipped_cpu_config_becomes_running_and_answers(head, name, tiny_checkpoint):
    """Fits the 2-CPU head with every replica it ships; at one replica a deployment, becomes RUNNING and
    answers each model it serves."""
    config = localized(name, head.http_port, tiny_checkpoint("llama"))
    cpus = [{"CPU": float(NUM_CPUS)}]
    assert launcher_status.unfit_reason(launcher_status.config_needs(config), cpus, name) is None
    launcher.deploy(as_deployed(config, name), head.dashboard_url)
    apps = config["applications"]
    launcher.wait_until_running(head.dashboard_url, [app["name"] for app in apps], 300, name, fixed_cluster=True)
    for app in apps:
        base = head.base_url + app.get("route_prefix", "/").rstrip("/")
        for model in served_model_ids(app):
            body = {"model": model, "prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True}
            response = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 4


def stream_completion(url: str, model: str, result: dict, first_chunk: threading.Event) -> None:
    """A long streamed completion: ``result`` gets its last event and the time it ended."""
    body = {"model": model, "prompt": "Once", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            for line in sse_lines(response):
                if line.startswith("data:"):
                    first_chunk.set()
                    result["last"] = line[5:].strip()
    except httpx.HTTPError as error:
        result["error"] = repr(error)
    result["ended"] = time.monotonic()
    first_chunk.set()


def test_stop_lets_the_stream_in_flight_finish_and_ends_the_head(head):
    """Last in the module: the head is gone after it (the fixture's stop then finds nothing)."""
    status = launcher.serve_details(head.dashboard_url)
    (app,) = [app["deployed_app_config"] for app in status["applications"].values()]
    result, first_chunk = {}, threading.Event()
    model = sorted(served_model_ids(app))[0]
    thread = threading.Thread(target=stream_completion, args=(head.base_url, model, result, first_chunk))
    thread.start()
    assert first_chunk.wait(60) and "ended" not in result, result
    started = time.monotonic()
    launcher.stop_cluster(head.dashboard_port, head.gcs_port)
    stopped = time.monotonic()
    thread.join(30)
    assert result.get("last") == "[DONE]" and "error" not in result, result
    assert result["ended"] > started  # it was in flight when the stop began, and finished
    assert stopped - result["ended"] < STOP_BUDGET_S, f"the stop took {stopped - result['ended']:.1f} s after it"
    assert not ray_processes.head_processes(head.gcs_port)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{head.base_url}/v1/models", timeout=5)
    assert json.dumps(result)  # for the log on failure
