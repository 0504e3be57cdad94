"""The Serve application builder that ``serve run`` / ``serve deploy`` reach through ``import_path``.

    import_path: serval.serve:build_openai_app      # (serval/serve.py re-exports this module's builders)
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

from cluster.placement import engine_bundles, nonzero, placement_strategy, uses_gpus
from deployments.config_errors import validated
from deployments.deployment_options import DeploymentConfig
from deployments.ingress import IngressLLMServer, OpenAiIngress
from deployments.llm_config import LLMConfig, LLMServingArgs
from deployments.llm_server import LLMServer
from deployments.pd_config import PDServingArgs
from deployments.pd_servers import PDDecodeServer, PrefillServer
from deployments.placement_config import ACCELERATOR_HINT, accelerator_resource

INGRESS_DEPLOYMENT_NAME = "OpenAiIngress"
DEFAULT_REPLICA_NUM_CPUS = 1  # Serve's default for a replica actor


def replica_resources(actor_options: dict[str, Any]) -> dict[str, float]:
    """What the replica actor itself asks Ray for (Serve's defaults where unset)."""
    resources = {
        "CPU": actor_options.get("num_cpus", DEFAULT_REPLICA_NUM_CPUS),
        "GPU": actor_options.get("num_gpus", 0),
        **actor_options.get("resources", {}),
    }
    if "memory" in actor_options:
        resources["memory"] = actor_options["memory"]
    return resources


def placement_options(llm_config: LLMConfig, actor_options: dict[str, Any]) -> dict[str, Any]:
    """Each replica's placement group when its engine runs Ray workers (TP/PP): one bundle per worker
    holding what it asks for (``placement_group_config``'s bundles, else the engine's), a GPU type's resource
    in each, the replica's own resources added to bundle 0 (Serve places the replica there), as Ray Serve
    LLM builds it."""
    engine_args = llm_config.engine_args()
    parallel = engine_args.create_parallel_config()
    if parallel.executor_backend != "ray":
        return {}
    bundles = engine_bundles(parallel, uses_gpus(engine_args.device))
    configured = llm_config.placement_group_config
    strategy = placement_strategy(parallel) if configured is None else configured.strategy
    if llm_config.accelerator_type is not None:
        for bundle in bundles:
            bundle.setdefault(accelerator_resource(llm_config.accelerator_type), ACCELERATOR_HINT)
    for name, amount in replica_resources(actor_options).items():
        bundles[0][name] = bundles[0].get(name, 0.0) + amount
    return {"placement_group_bundles": [nonzero(bundle) for bundle in bundles], "placement_group_strategy": strategy}


def server_options(llm_config: LLMConfig) -> dict[str, Any]:
    """``Deployment.options`` for one model's LLM servers: its ``deployment_config`` (Serve's options), the
    router's view of the engine, the runtime_env, a CUDA engine's GPU and the placement group."""
    options = llm_config.deployment_config.to_options()
    if llm_config.uses_kv_router():
        router = options["request_router_config"]
        router["request_router_kwargs"] = {
            **router.get("request_router_kwargs", {}),
            **llm_config.router_engine_kwargs(),
        }
    actor_options = options.setdefault("ray_actor_options", {})
    if llm_config.runtime_env is not None:  # the LLM config's wins, as in Ray Serve LLM
        actor_options["runtime_env"] = {**actor_options.get("runtime_env", {}), **llm_config.runtime_env}
    engine_args = llm_config.engine_args()
    if engine_args.create_parallel_config().executor_backend != "ray" and engine_args.device == "cuda":
        actor_options.setdefault("num_gpus", 1)  # the engine runs in the replica: the replica holds the GPU
        if llm_config.accelerator_type is not None:
            actor_options.setdefault("accelerator_type", llm_config.accelerator_type)
    options.update(placement_options(llm_config, actor_options))
    return options


def build_llm_server(
    llm_config: LLMConfig, server_class: type = LLMServer, name: str | None = None, *extra_args: Any
) -> Application:
    """One model's LLM-server deployment (``server_class``, named ``LLMServer:<model id>`` unless ``name``
    or its ``deployment_config.name`` says), bound to its config and ``extra_args``."""
    options = server_options(llm_config)
    options.pop("name", None)
    if options.get("user_config") is not None and not hasattr(server_class, "reconfigure"):
        raise ValueError(
            f"deployment_config.user_config: Serve hands it to the deployment's reconfigure(), which "
            f"{server_class.__name__} does not have."
        )
    deployment = serve.deployment(server_class).options(name=name or llm_config.server_deployment_name(), **options)
    return deployment.bind(llm_config, *extra_args)


def build_ingress(deployment_config: DeploymentConfig) -> Any:
    """The ``OpenAiIngress`` deployment (named so unless ``deployment_config.name`` says)."""
    options = deployment_config.to_options()
    return serve.deployment(OpenAiIngress).options(**{"name": INGRESS_DEPLOYMENT_NAME, **options})


def build_openai_app(args: dict[str, Any] | LLMServingArgs) -> Application:
    """Validates ``args`` (unknown keys are an error here, at deploy time) and builds the app; a bad config
    raises ``ConfigError``, one line naming the key (Serve's DEPLOY_FAILED message)."""
    serving_args = args if isinstance(args, LLMServingArgs) else validated(LLMServingArgs, args)
    if not serving_args.separate_ingress:  # one model: its LLM servers are the HTTP ingress
        [llm_config] = serving_args.llm_configs
        return build_llm_server(llm_config, IngressLLMServer, None, serving_args.server_options())
    servers = {config.model_id: build_llm_server(config) for config in serving_args.llm_configs}
    ingress = build_ingress(serving_args.ingress_deployment_config)
    return ingress.bind(servers, serving_args.server_options(), serving_args.migration_limit)


def build_pd_openai_app(args: dict[str, Any] | PDServingArgs) -> Application:
    """Validates ``args`` (``ConfigError`` as above) and builds the disaggregated app: ingress -> decode pool ->
    prefill pool."""
    pd_args = args if isinstance(args, PDServingArgs) else validated(PDServingArgs, args)
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
    ingress = build_ingress(pd_args.ingress_deployment_config)
    return ingress.bind({pd_args.decode_config.model_id: decode}, pd_args.server_options())
