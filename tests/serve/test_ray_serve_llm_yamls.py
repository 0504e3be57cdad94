"""Ray Serve LLM's documented YAMLs deploy on Serval with only the import path and the model changed.

The fixtures under ``ray_serve_llm/`` are Ray's documentation examples as published (their source is noted in
each): the quickstart's two-model configuration, the multi-LoRA example, and prefill/decode disaggregation
with NIXL. Each is deployed on a real Ray head on 127.0.0.1 (``tests/helm/local_head.py``, one for the module)
through the dashboard's REST API, as ``serve deploy`` does, and answers one completion per model.

What ``localized`` changes, and nothing else: ``import_path`` (``ray.serve.llm:`` -> ``serval.serve:``), where
the weights are (``model_source``, or ``model_id`` where the example has no source, to a local checkpoint; the
LoRA adapters' directory to ``models/tiny-llama-loras``), the HTTP port (Serve's top-level ``http_options``, a
free one), and ``accelerator_type: A10G``, dropped because this head has CPUs only and a GPU type runs the
engine on CUDA (that the unchanged value becomes the A10G resource and CUDA is checked in
tests/serve/test_llm_config.py). Replicas keep Serve's default of one CPU each: the head declares enough
logical CPUs for each example's ``min_replicas`` (the P/D example starts eight engines, so it serves the
session's tiny checkpoint, whose KV cache is a quarter of models/tiny-llama's).
"""

from __future__ import annotations

import copy
from pathlib import Path

import httpx
import pytest
import yaml

from serval.launcher import lifecycle as launcher
from tests.helm.local_head import start_head
from tests.serve.cluster import LOOPBACK

pytestmark = [pytest.mark.ray, pytest.mark.serve, pytest.mark.slow]

FIXTURES = Path(__file__).resolve().parent / "ray_serve_llm"
LORA_ADAPTERS = "models/tiny-llama-loras"  # lora-1 and lora-2, PEFT adapters of models/tiny-llama
NUM_CPUS = 9  # logical: the P/D example's 2 + 6 replicas at Serve's 1 CPU each, and the ingress
START_TIMEOUT_S = 600.0


def load_fixture(name: str) -> dict:
    with open(FIXTURES / name, encoding="utf-8") as f:
        return yaml.safe_load(f)


def pools(app: dict) -> list[dict]:
    args = app["args"]
    return args.get("llm_configs") or [args["prefill_config"], args["decode_config"]]


def localized(name: str, http_port: int, checkpoint: str) -> dict:
    """Ray's example ``name`` with only what the module docstring lists changed."""
    original = load_fixture(name)
    config = copy.deepcopy(original)
    config["http_options"] = {"host": LOOPBACK, "port": http_port}
    for app in config["applications"]:
        assert app["import_path"].startswith("ray.serve.llm:")
        app["import_path"] = app["import_path"].replace("ray.serve.llm:", "serval.serve:")
        for llm_config in pools(app):
            loading = llm_config["model_loading_config"]
            loading["model_source" if "model_source" in loading else "model_id"] = checkpoint
            if "lora_config" in llm_config:
                llm_config["lora_config"]["dynamic_lora_loading_path"] = LORA_ADAPTERS
            assert llm_config.pop("accelerator_type", "A10G") == "A10G"
    return config


def served_models(app: dict) -> list[str]:
    return sorted({llm_config["model_loading_config"]["model_id"] for llm_config in pools(app)})


@pytest.fixture(scope="module")
def head():
    started = start_head(num_cpus=NUM_CPUS)
    try:
        yield started
    finally:
        launcher.stop_cluster(started.dashboard_port, started.gcs_port, drain_timeout_s=10)


def deploy(head, config: dict, name: str) -> None:
    launcher.deploy(config, head.dashboard_url)
    apps = [app["name"] for app in config["applications"]]
    launcher.wait_until_running(head.dashboard_url, apps, START_TIMEOUT_S, name, fixed_cluster=True)


def complete(head, model: str) -> dict:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True}
    response = httpx.post(f"{head.base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    return response.json()


def test_the_quickstart_configuration_serves_both_models(head):
    config = localized("quickstart.yaml", head.http_port, "models/tiny-llama")
    deploy(head, config, "quickstart.yaml")
    (app,) = config["applications"]
    assert served_models(app) == ["qwen-0.5b", "qwen-1.5b"]
    for model in served_models(app):
        assert complete(head, model)["model"] == model


def test_the_multi_lora_example_serves_an_adapter_by_rays_name(head):
    config = localized("multi_lora.yaml", head.http_port, "models/tiny-llama")
    deploy(head, config, "multi_lora.yaml")
    assert complete(head, "qwen-0.5b:lora-1")["model"] == "qwen-0.5b:lora-1"


def test_the_prefill_decode_example_serves_through_both_pools(head, tiny_checkpoint):
    checkpoint = tiny_checkpoint("llama")
    config = localized("pd_nixl.yaml", head.http_port, checkpoint)
    deploy(head, config, "pd_nixl.yaml")
    status = launcher.serve_details(head.dashboard_url)
    deployments = status["applications"]["pd-disaggregation-nixl"]["deployments"]
    running = {name: len(d["replicas"]) for name, d in deployments.items() if name != "OpenAiIngress"}
    assert sorted(running.values()) == [2, 6], running  # each pool at its min_replicas
    complete(head, checkpoint)
