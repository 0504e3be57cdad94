"""The Serve application builder that ``serve run`` / ``serve deploy`` reach through ``import_path``.

    import_path: deployments.app:build_openai_app
    args: {llm_configs: [...], ingress_deployment_config: {...}, api_keys: [...], request_limits: {...}}

One ``LLMServer:<model id>`` deployment per model (its replicas are the
data-parallel copies) behind one ``OpenAiIngress`` deployment that routes by
the request's ``model``; with ``separate_ingress: false`` an app of one
model has none: its ``LLMServer:<model id>`` replicas serve HTTP themselves
(``IngressLLMServer``).

    import_path: deployments.app:build_pd_openai_app
    args: {prefill_config: {...}, decode_config: {...}, kv_transfer_config: {...}}

Disaggregated prefill and decode (``pd_config``, ``pd_servers``): the ingress
routes to the decode pool ``LLMServer:<model id>``, whose replicas have the
prefill pool ``PrefillServer:<model id>`` compute each prompt's KV first.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from cluster.placement import engine_bundles, placement_strategy, uses_gpus
from deployments.ingress import IngressLLMServer, OpenAiIngress
from deployments.llm_config import LLMConfig, LLMServingArgs
from deployments.llm_server import LLMServer
from deployments.pd_config import PDServingArgs
from deployments.pd_servers import PDDecodeServer, PrefillServer

INGRESS_DEPLOYMENT_NAME = "OpenAiIngress"
DEFAULT_REPLICA_NUM_CPUS = 1  # Serve's default for a replica actor


def placement_options(llm_config: LLMConfig, actor_options: dict[str, Any]) -> dict[str, Any]:
    """Each replica's placement group when its engine runs Ray workers (TP/PP): one bundle per
    worker, the replica's own resources added to bundle 0 (Serve places the replica there)."""
    engine_args = llm_config.engine_args()
    parallel = engine_args.create_parallel_config()
    if parallel.executor_backend != "ray":
        return {}
    replica_resources = {
        "CPU": actor_options.get("num_cpus", DEFAULT_REPLICA_NUM_CPUS),
        "GPU": actor_options.get("num_gpus", 0),
        **actor_options.get("resources", {}),
    }
    return {
        "placement_group_bundles": engine_bundles(parallel, uses_gpus(engine_args.device), replica_resources),
        "placement_group_strategy": placement_strategy(parallel),
    }


def build_llm_server(
    llm_config: LLMConfig, server_class: type = LLMServer, name: str | None = None, *extra_args: Any
) -> Application:
    """One model's LLM-server deployment (``server_class``, named ``LLMServer:<model id>`` unless ``name``
    says), bound to its config and ``extra_args``."""
    options = llm_config.deployment_config.to_options()
    if llm_config.runtime_env is not None:
        options["ray_actor_options"] = {**options.get("ray_actor_options", {}), "runtime_env": llm_config.runtime_env}
    options.update(placement_options(llm_config, options.get("ray_actor_options", {})))
    deployment = serve.deployment(server_class).options(name=name or llm_config.server_deployment_name(), **options)
    return deployment.bind(llm_config, *extra_args)


def build_openai_app(args: dict[str, Any] | LLMServingArgs) -> Application:
    """Validates ``args`` (unknown keys are an error here, at deploy time) and builds the app."""
    serving_args = args if isinstance(args, LLMServingArgs) else LLMServingArgs.model_validate(args)
    if not serving_args.separate_ingress:  # one model: its LLM servers are the HTTP ingress
        [llm_config] = serving_args.llm_configs
        return build_llm_server(llm_config, IngressLLMServer, None, serving_args.server_options())
    servers = {config.model_id: build_llm_server(config) for config in serving_args.llm_configs}
    ingress = serve.deployment(OpenAiIngress).options(
        name=INGRESS_DEPLOYMENT_NAME, **serving_args.ingress_deployment_config.to_options()
    )
    return ingress.bind(servers, serving_args.server_options(), serving_args.migration_limit)


def build_pd_openai_app(args: dict[str, Any] | PDServingArgs) -> Application:
    """Validates ``args`` and builds the disaggregated app: ingress -> decode pool -> prefill pool."""
    pd_args = args if isinstance(args, PDServingArgs) else PDServingArgs.model_validate(args)
    prefill = build_llm_server(
        pd_args.with_role(pd_args.prefill_config, "kv_producer"), PrefillServer, pd_args.prefill_deployment_name()
    )
    decode = build_llm_server(
        pd_args.with_role(pd_args.decode_config, "kv_consumer"),
        PDDecodeServer,
        None,
        prefill,
        pd_args.options.model_dump(),
    )
    ingress = serve.deployment(OpenAiIngress).options(
        name=INGRESS_DEPLOYMENT_NAME, **pd_args.ingress_deployment_config.to_options()
    )
    return ingress.bind({pd_args.decode_config.model_id: decode}, pd_args.server_options())
