"""Helpers for the Helm chart tests: real Helm renders (helm-python-sdk), and the schemas they must meet.

* ``render(chart, values)``: the chart's manifests, parsed, by kind.
* ``kuberay_validator()``: KubeRay 1.7's RayService v1 CRD schema (the ``openAPIV3Schema`` of
  ``ray.io_rayservices.yaml``, vendored in ``schemas/``), made strict the way kubeconform's CRD schemas
  are: an object that lists its properties accepts no others.
* ``serve_config_errors(config)``: what ``serve deploy`` (Ray Serve's ``ServeDeploySchema``) and Serval's
  app builders refuse in a Serve config.
* ``gpus_needed(config)``: GPUs a Serve config's replicas take at start, at most, and per replica.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import yaml

from deployments.llm_config import SERVAL_ROOT

CHART_DIR = SERVAL_ROOT / "helm" / "serval"
EXAMPLES = sorted((CHART_DIR / "examples").glob("*.yaml"))
CRD_SCHEMA = Path(__file__).resolve().parent / "schemas" / "rayservice-v1.openapi.json"
# Where the task's shared checkout keeps KubeRay's schema; the vendored copy must equal it when present.
SHARED_CRD_SCHEMA = SERVAL_ROOT.parent / "shared" / "kuberay" / "rayservice-v1.openapi.json"
PD_IMPORT_PATH = "deployments.app:build_pd_openai_app"


def load_yaml(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def render(chart, values: dict | None = None, name: str = "serval") -> dict[str, list[dict]]:
    """Kind -> the rendered documents of that kind; ``"NOTES"`` -> [the NOTES.txt text]."""
    by_kind: dict[str, list] = {}
    for path, text in chart.render(values=values, name=name, namespace="llm").items():
        if path.endswith("NOTES.txt"):
            by_kind["NOTES"] = [text]
            continue
        for document in yaml.safe_load_all(text):
            if document:
                by_kind.setdefault(document["kind"], []).append(document)
    return by_kind


def rayservice(chart, values: dict | None = None) -> dict:
    (service,) = render(chart, values)["RayService"]
    return service


def serve_config_of(service: dict) -> dict:
    return yaml.safe_load(service["spec"]["serveConfigV2"])


def pods(service: dict) -> list[dict]:
    """The pod templates: the head's, then each worker group's."""
    cluster = service["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"], *(group["template"] for group in cluster["workerGroupSpecs"])]


def _strict(schema):
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: _strict(value) for key, value in schema.items()}
    if (
        strict.get("type") == "object"
        and isinstance(strict.get("properties"), dict)
        and "additionalProperties" not in strict
        and not strict.get("x-kubernetes-preserve-unknown-fields")
    ):
        strict["additionalProperties"] = False
    return strict


@cache
def kuberay_validator():
    from jsonschema import Draft202012Validator

    with open(CRD_SCHEMA, encoding="utf-8") as f:
        return Draft202012Validator(_strict(json.load(f)))


def kuberay_errors(service: dict) -> list[str]:
    """Every way ``service`` breaks the strict RayService schema, as 'path: message' lines."""
    return [
        f"{'/'.join(map(str, error.absolute_path))}: {error.message}"
        for error in kuberay_validator().iter_errors(service)
    ]


def serve_config_errors(config: dict) -> list[str]:
    """Empty when ``serve deploy`` accepts ``config`` and Serval's builder accepts each app's ``args``."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    from deployments.llm_config import LLMServingArgs
    from deployments.pd_config import PDServingArgs

    try:
        ServeDeploySchema.model_validate(config)
        for app in config["applications"]:
            builder_args = PDServingArgs if app["import_path"] == PD_IMPORT_PATH else LLMServingArgs
            builder_args.model_validate(app["args"])
    except ValidationError as error:
        return [str(error)]
    return []


def _llm_configs(app: dict) -> list[dict]:
    args = app["args"]
    return [args[key] for key in ("prefill_config", "decode_config") if key in args] or args["llm_configs"]


def _gpus_per_replica(llm_config: dict) -> float:
    """A replica's GPUs: one per Ray worker (TP x PP > 1), else what the replica actor asks for."""
    engine = llm_config.get("engine_kwargs", {})
    world_size = engine.get("tensor_parallel_size", 1) * engine.get("pipeline_parallel_size", 1)
    if world_size > 1:
        return world_size
    return llm_config.get("deployment_config", {}).get("ray_actor_options", {}).get("num_gpus", 0)


def _replica_range(llm_config: dict, app: dict) -> tuple[int, int]:
    """(replicas at start, most replicas); the app's ``deployments:`` overrides count."""
    deployment = llm_config.get("deployment_config", {})
    autoscaling = deployment.get("autoscaling_config")
    if autoscaling:
        start = autoscaling.get("initial_replicas", autoscaling.get("min_replicas", 1))
        return start, autoscaling.get("max_replicas", 1)
    replicas = deployment.get("num_replicas", 1)
    model_id = llm_config["model_loading_config"]["model_id"]
    for override in app.get("deployments", []):
        if override["name"] == f"LLMServer:{model_id}":
            replicas = override.get("num_replicas", replicas)
    return replicas, replicas


def gpus_needed(config: dict) -> tuple[float, float, float]:
    """(GPUs at start, GPUs at most, GPUs of the largest replica) for a Serve config."""
    start = most = largest = 0
    for app in config["applications"]:
        for llm_config in _llm_configs(app):
            per_replica = _gpus_per_replica(llm_config)
            first, last = _replica_range(llm_config, app)
            start, most = start + first * per_replica, most + last * per_replica
            largest = max(largest, per_replica)
    return start, most, largest
