"""The LLM config's ``request_router_config`` (deployments/llm_config.py): KVAwareRouter's options are checked
at deploy time (by the app builder), its block size and hash come from the engine's arguments, and it needs
what it routes on."""

import pytest
from pydantic import ValidationError

from deployments.llm_config import LLMConfig, LLMServingArgs

KV_ROUTER = {"request_router_class": "deployments.routing:KVAwareRouter"}


def config(router: dict, **engine_kwargs) -> dict:
    return {
        "model_loading_config": {"model_id": "m", "model_source": "models/tiny-llama"},
        "engine_kwargs": engine_kwargs,
        "deployment_config": {"num_replicas": 2, "request_router_config": router},
    }


def test_the_engines_block_size_and_hash_reach_the_router():
    from deployments.app import server_options

    llm = LLMConfig.model_validate(config({**KV_ROUTER, "request_router_kwargs": {"load_weight": 1}}, block_size=32))
    router = server_options(llm)["request_router_config"]
    assert router["request_router_kwargs"] == {"load_weight": 1, "block_size": 32, "hash_algo": "sha256"}
    assert router["request_routing_stats_period_s"] == 0.5 and llm.uses_kv_router()


@pytest.mark.parametrize(
    "kwargs, engine_kwargs, message",
    [
        ({"prefix_wieght": 3}, {}, "prefix_wieght"),
        ({"load_weight": -1}, {}, "load_weight"),
        ({"block_size": 8}, {"block_size": 16}, "comes from engine_kwargs"),
        ({}, {"enable_prefix_caching": False}, "enable_prefix_caching"),
    ],
)
def test_bad_router_settings_are_refused_with_their_name(kwargs, engine_kwargs, message):
    with pytest.raises(ValidationError, match=message):
        LLMConfig.model_validate(config({**KV_ROUTER, "request_router_kwargs": kwargs}, **engine_kwargs))


def test_other_routers_options_are_theirs_to_check():
    llm = LLMConfig.model_validate(
        config(
            {
                "request_router_class": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
                "request_router_kwargs": {"x": 1},
            }
        )
    )
    assert not llm.uses_kv_router()


def test_the_kv_router_needs_the_separate_ingress():
    with pytest.raises(ValidationError, match="separate_ingress"):
        LLMServingArgs.model_validate({"llm_configs": [config(KV_ROUTER)], "separate_ingress": False})


def test_the_app_builder_refuses_bad_router_options_by_name():
    """Where a deploy refuses them: Serve's controller runs this builder on the config's ``args`` before any
    replica starts, and its error is the app's DEPLOY_FAILED message, which the launcher raises (that path,
    on a real cluster: tests/serve/test_scaling.py::test_an_unknown_key_fails_the_deploy_with_its_name)."""
    from deployments.app import build_openai_app
    from deployments.config_errors import ConfigError

    bad = config({**KV_ROUTER, "request_router_kwargs": {"prefix_wieght": 3.0}})
    with pytest.raises(ConfigError) as refused:
        build_openai_app({"llm_configs": [bad]})
    path = "args.llm_configs[0].deployment_config.request_router_config.request_router_kwargs.prefix_wieght"
    assert str(refused.value) == f"{path}: unknown key"
