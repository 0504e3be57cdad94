"""Ray Serve LLM's documented YAMLs deploy on Serval with only the import path and the model changed.

The fixtures under ``ray_serve_llm/`` are Ray's documentation examples as published (their source is noted in
each): the quickstart's two-model configuration, the multi-LoRA example, and prefill/decode disaggregation
with NIXL. Each is deployed on a real Ray head on 127.0.0.1 (``tests/helm/local_head.py``, one for the module)
through the dashboard's REST API, as ``serve deploy`` does, and answers one completion per model over the
openai client. Beside them, ``EVERY_KEY``: one YAML with every LLMConfig key the README calls honoured.

What ``localized`` changes, and nothing else: ``import_path`` (``ray.serve.llm:`` -> ``serval.serve:``), where
the weights are (``model_source``, or ``model_id`` where the example has no source, to a local checkpoint; the
LoRA adapters' directory to ``models/tiny-llama-loras``), the HTTP port (Serve's top-level ``http_options``, a
free one), and ``accelerator_type: A10G``, dropped because this head has CPUs only and a GPU type runs the
engine on CUDA (that the unchanged value becomes the A10G resource and CUDA is checked in
tests/serve/test_llm_config.py). Replicas keep Serve's default of one CPU each: the head declares enough
logical CPUs for one example's replicas while the one before it stops. The local checkpoint is the session's
tiny one where the example allows it: with no engine_kwargs to bound it, an engine's KV cache is
``max_num_seqs`` x the model's 4096 tokens, 0.5 GiB for it and 2 GiB for models/tiny-llama (seconds to
allocate); the LoRA example keeps models/tiny-llama, its adapters' base.

One more change, for the P/D example only, and said where it is made: its pools are deployed at one replica
each (as published, two and six: eight engines), and the published counts are checked in the app Serval
builds from the file, unchanged, without starting it.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import openai
import pytest
import yaml

from serval.launcher import lifecycle as launcher
from serval.launcher import processes as ray_processes
from tests.helm.local_head import start_head
from tests.serve.cluster import LOOPBACK

pytestmark = [pytest.mark.ray, pytest.mark.serve, pytest.mark.slow]

FIXTURES = Path(__file__).resolve().parent / "ray_serve_llm"
LORA_ADAPTERS = "models/tiny-llama-loras"  # lora-1 and lora-2, PEFT adapters of models/tiny-llama
# logical: the replicas of EVERY_KEY (2.6 CPUs with its ingress) and of the P/D example at one replica a pool
# (2.1) side by side, while Serve stops the one and starts the other
NUM_CPUS = 5
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
        # By id, at once (SIGKILL after 1 s): nothing is in flight, and Serve's own shutdown (each replica's
        # graceful stop) is proved in tests/serve/test_shipped_configs.py, not here.
        ray_processes.stop_head(started.gcs_port)


def deploy(head, config: dict, name: str) -> None:
    launcher.deploy(config, head.dashboard_url)
    apps = [app["name"] for app in config["applications"]]
    launcher.wait_until_running(head.dashboard_url, apps, START_TIMEOUT_S, name, fixed_cluster=True)


def complete(head, model: str) -> openai.types.Completion:
    """One completion over the openai client, as a Ray Serve LLM user calls the app."""
    client = openai.OpenAI(base_url=f"{head.base_url}/v1", api_key="none", max_retries=0, timeout=120)
    completion = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert completion.usage.completion_tokens == 4
    return completion


def test_the_quickstart_configuration_serves_both_models(head, tiny_checkpoint):
    config = localized("quickstart.yaml", head.http_port, tiny_checkpoint("llama"))
    deploy(head, config, "quickstart.yaml")
    (app,) = config["applications"]
    assert served_models(app) == ["qwen-0.5b", "qwen-1.5b"]
    for model in served_models(app):
        assert complete(head, model).model == model


def test_the_multi_lora_example_serves_an_adapter_by_rays_name(head):
    config = localized("multi_lora.yaml", head.http_port, "models/tiny-llama")
    deploy(head, config, "multi_lora.yaml")
    assert complete(head, "qwen-0.5b:lora-1").model == "qwen-0.5b:lora-1"


# Not one of Ray's examples: every LLMConfig key the README calls honoured, in one YAML written as a Ray Serve LLM
# user writes it (the report of issue 58, whose replica never started, and a TP=2 engine with a bundle per worker).
# max_num_seqs 16 bounds each KV cache to 16 sequences (256 by default: 0.5 GiB here, seconds to allocate).
EVERY_KEY = """
applications:
- name: every_key
  route_prefix: /
  import_path: serval.serve:build_openai_app
  args:
    llm_configs:
    - model_loading_config: {model_id: qwen-0.5b, model_source: models/tiny-llama}
      engine_kwargs: {max_model_len: 1024, max_num_seqs: 16, enable_lora: true, max_loras: 2}
      lora_config: {dynamic_lora_loading_path: models/tiny-llama-loras, max_num_adapters_per_replica: 2}
      placement_group_config: {bundles: [{CPU: 0.5}], strategy: PACK}
      runtime_env: {env_vars: {SERVAL_BAR: "1"}}
      deployment_config:
        autoscaling_config: {min_replicas: 1, max_replicas: 1, upscaling_factor: 1.0}
        graceful_shutdown_wait_loop_s: 2
    - model_loading_config: {model_id: tiny-tp2, model_source: models/tiny-llama}
      engine_kwargs: {max_model_len: 512, max_num_seqs: 16, tensor_parallel_size: 2}
      placement_group_config: {bundles: [{CPU: 0.25}, {CPU: 0.25}], strategy: STRICT_PACK}
      deployment_config: {ray_actor_options: {num_cpus: 0.5}}
"""


def bundle_cpus(actor) -> float:
    """The CPUs an actor in a placement group holds (Ray names them CPU_group_<bundle>_<group id>)."""
    return sum(v for k, v in actor.required_resources.items() if re.fullmatch(r"CPU_group_\d+_[0-9a-f]+", k))


def test_every_honoured_key_deploys_and_each_worker_takes_its_own_bundle(head):
    from ray.util.state import list_actors

    config = {"http_options": {"host": LOOPBACK, "port": head.http_port}, **yaml.safe_load(EVERY_KEY)}
    deploy(head, config, "every key")
    for model in ("qwen-0.5b", "qwen-0.5b:lora-1", "tiny-tp2"):
        assert complete(head, model).model == model
    actors = list_actors(address=head.dashboard_url, filters=[("state", "=", "ALIVE")], detail=True, limit=1000)
    replicas = {a.placement_group_id: a for a in actors if a.class_name.startswith("ServeReplica:every_key:LLM")}
    assert len(replicas) == 2
    for group, replica in replicas.items():
        workers = sorted(
            bundle_cpus(a) for a in actors if a.class_name == "RayWorker" and a.placement_group_id == group
        )
        cores = [a for a in actors if a.class_name == "EngineCoreActor" and a.placement_group_id == group]
        assert len(cores) == 1 and bundle_cpus(cores[0]) == 0  # the core sits in bundle 0 and asks for nothing
        model = replica.class_name.rsplit("LLMServer:", 1)[1]
        expected_env = {"qwen-0.5b": {"SERVAL_BAR": "1"}, "tiny-tp2": None}
        assert workers == {"qwen-0.5b": [0.5], "tiny-tp2": [0.25, 0.25]}[model]
        # runtime_env reaches the replica, its engine core and its workers (the other model has none)
        envs = [json.loads(a.serialized_runtime_env).get("env_vars") for a in actors if a.placement_group_id == group]
        assert len(envs) == 2 + len(workers) and set(map(str, envs)) == {str(expected_env[model])}


PUBLISHED_POOLS = {"PrefillServer": (2, 4), "LLMServer": (6, 10)}  # pd_nixl.yaml's (min_replicas, max_replicas)


def pool_autoscaling(deployments: dict[str, dict]) -> dict[str, tuple[int, int]]:
    """(min_replicas, max_replicas) of each pool's deployment (``PrefillServer:<id>``, ``LLMServer:<id>``)."""
    return {
        name.split(":", 1)[0]: (scaling["min_replicas"], scaling["max_replicas"])
        for name, scaling in deployments.items()
        if name != "OpenAiIngress"
    }


def test_the_prefill_decode_example_builds_each_pool_at_its_published_replica_counts(tiny_checkpoint):
    """The P/D example as published, unchanged but for ``localized``: the app Serval builds from it (what Serve's
    controller deploys; built here, not started) gives each pool its own autoscaling_config, min_replicas 2 and
    6. Serve starts a deployment at its min_replicas: the test below starts the pools at one replica each."""
    from ray.serve._private.build_app import build_app

    from serval.serve import build_pd_openai_app

    (app,) = localized("pd_nixl.yaml", 8000, tiny_checkpoint("llama"))["applications"]
    built = build_app(build_pd_openai_app(app["args"]), name=app["name"])
    pools = [d for d in built.deployments if d.name != "OpenAiIngress"]
    scaling = {d.name: vars(d._deployment_config.autoscaling_config) for d in pools}
    assert pool_autoscaling(scaling) == PUBLISHED_POOLS


def test_the_prefill_decode_example_serves_through_both_pools(head, tiny_checkpoint):
    """The P/D example with its pools at one replica each (published: 2 and 6, checked above; eight engines
    would make this the module's longest test) and their max_replicas as published: each pool runs its
    min_replicas with its own autoscaling_config, and the app answers through both."""
    checkpoint = tiny_checkpoint("llama")
    config = localized("pd_nixl.yaml", head.http_port, checkpoint)
    args = config["applications"][0]["args"]
    for pool in ("prefill_config", "decode_config"):
        args[pool]["deployment_config"]["autoscaling_config"]["min_replicas"] = 1
    deploy(head, config, "pd_nixl.yaml")
    status = launcher.serve_details(head.dashboard_url)
    deployments = status["applications"]["pd-disaggregation-nixl"]["deployments"]
    scaling = {name: d["deployment_config"].get("autoscaling_config") for name, d in deployments.items()}
    assert pool_autoscaling(scaling) == {pool: (1, most) for pool, (_, most) in PUBLISHED_POOLS.items()}
    running = {name.split(":", 1)[0]: len(d["replicas"]) for name, d in deployments.items() if name != "OpenAiIngress"}
    assert running == {"PrefillServer": 1, "LLMServer": 1}, running  # each pool at its min_replicas
    complete(head, checkpoint)
