"""The serve YAML's `args` (Ray Serve LLM's vocabulary): validated at deploy time, unknown keys named."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from deployments.llm_config import SERVAL_ROOT, LLMConfig, LLMServingArgs

MINIMAL = {"model_loading_config": {"model_id": "tiny-llama", "model_source": "models/tiny-llama"}}


def test_default_yaml_validates_and_maps_to_engine_args():
    with open(SERVAL_ROOT / "configs/serve/default.yaml", encoding="utf-8") as f:
        app = yaml.safe_load(f)["applications"][0]
    assert app["import_path"] == "deployments.app:build_openai_app"
    args = LLMServingArgs.model_validate(app["args"])
    config = args.llm_configs[0]
    assert config.model_id == "smollm2-135m-instruct"
    assert config.server_deployment_name() == "LLMServer:smollm2-135m-instruct"
    assert config.deployment_config.to_options()["num_replicas"] == 1
    # Relative sources resolve against the checkout, whatever the replica's working directory.
    source = config.model_loading_config.resolved_source()
    assert source == str(SERVAL_ROOT / "models/smollm2-135m-instruct")
    assert (Path(source) / "config.json").is_file()  # written by `make models` (make test runs it first)


@pytest.mark.parametrize(
    "bad, key",
    [
        ({**MINIMAL, "engine_kwarg": {}}, "engine_kwarg"),
        ({**MINIMAL, "engine_kwargs": {"max_num_seq": 8}}, "max_num_seq"),
        ({**MINIMAL, "deployment_config": {"num_replica": 2}}, "num_replica"),
        ({"model_loading_config": {"model_id": "m", "source": "x"}}, "source"),
    ],
)
def test_unknown_keys_are_an_error_naming_the_key(bad, key):
    with pytest.raises(ValidationError, match=key):
        LLMServingArgs.model_validate({"llm_configs": [bad]})


def test_bad_values_and_duplicates_are_refused():
    with pytest.raises(ValidationError, match="max_num_seqs"):
        LLMConfig.model_validate({**MINIMAL, "engine_kwargs": {"max_num_seqs": 0}})
    with pytest.raises(ValidationError, match="model_source"):
        LLMConfig.model_validate({**MINIMAL, "engine_kwargs": {"model": "x"}})
    with pytest.raises(ValidationError, match="Duplicate model_id"):
        LLMServingArgs.model_validate({"llm_configs": [MINIMAL, MINIMAL]})
    with pytest.raises(ValidationError, match="num_replicas is not allowed when autoscaling_config"):  # Serve's
        LLMConfig.model_validate(
            {
                **MINIMAL,
                "deployment_config": {"num_replicas": 2, "autoscaling_config": {"min_replicas": 1, "max_replicas": 2}},
            }
        )
    with pytest.raises(ValidationError, match="llm_configs"):
        LLMServingArgs.model_validate({"llm_configs": []})


def test_model_ids_become_safe_deployment_names():
    config = LLMConfig.model_validate({"model_loading_config": {"model_id": "meta-llama/Llama-3.1-8B"}})
    assert config.server_deployment_name() == "LLMServer:meta-llama--Llama-3.1-8B"
    assert config.model_loading_config.resolved_source() == str(SERVAL_ROOT / "meta-llama/Llama-3.1-8B")


def test_llm_configs_may_be_yaml_files(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                **MINIMAL,
                "deployment_config": {
                    "autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 32}
                },
            }
        )
    )
    config = LLMServingArgs.model_validate({"llm_configs": [str(path)]}).llm_configs[0]
    options = config.deployment_config.to_options()
    assert "num_replicas" not in options
    assert options["autoscaling_config"]["max_replicas"] == 4


SHIPPED_SERVE_CONFIGS = sorted(
    [*(SERVAL_ROOT / "configs/serve").glob("*.yaml"), *(SERVAL_ROOT / "benchmarks/configs").glob("*.yaml")]
)


@pytest.mark.parametrize("path", SHIPPED_SERVE_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_serve_config_is_valid(path):
    from ray.serve.schema import ServeDeploySchema

    with open(path, encoding="utf-8") as f:
        config = yaml.safe_load(f)
    ServeDeploySchema.model_validate(config)  # what `serve deploy` checks
    for app in config["applications"]:
        if app["import_path"] == "deployments.app:build_pd_openai_app":
            from deployments.pd_config import PDServingArgs

            PDServingArgs.model_validate(app["args"])  # what the PD builder checks
            continue
        args = LLMServingArgs.model_validate(app["args"])  # what the builder checks
        names = {c.server_deployment_name() for c in args.llm_configs}
        assert {d["name"] for d in app.get("deployments", [])} <= names


def test_pd_yaml_validates_and_gives_each_pool_its_role():
    from deployments.pd_config import PDServingArgs

    with open(SERVAL_ROOT / "configs/serve/pd.yaml", encoding="utf-8") as f:
        app = yaml.safe_load(f)["applications"][0]
    assert app["import_path"] == "deployments.app:build_pd_openai_app"
    args = PDServingArgs.model_validate(app["args"])
    assert args.prefill_deployment_name() == "PrefillServer:tiny-llama"
    prefill = args.with_role(args.prefill_config, "kv_producer").engine_args()
    decode = args.with_role(args.decode_config, "kv_consumer").engine_args()
    assert (prefill.kv_transfer_config.kv_role, decode.kv_transfer_config.kv_role) == ("kv_producer", "kv_consumer")
    assert decode.kv_transfer_config.kv_connector == "object_store"
    direct = PDServingArgs.model_validate({**app["args"], "kv_transfer_config": {"kv_connector": "ray_direct"}})
    assert direct.with_role(direct.decode_config, "kv_consumer").engine_args().distributed_executor_backend == "ray"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"decode_config": {"model_loading_config": {"model_id": "other"}}}, "same model_id"),
        ({"decode_config": {**MINIMAL, "engine_kwargs": {"block_size": 32}}}, "same block_size"),
        ({"prefill_config": {**MINIMAL, "engine_kwargs": {"tensor_parallel_size": 2}}}, "tensor_parallel_size=1"),
        (
            {"prefill_config": {**MINIMAL, "engine_kwargs": {"kv_transfer_config": {"kv_role": "kv_consumer"}}}},
            "kv_role must be one of",
        ),
        ({"kv_transfer_config": {"kv_connector": "nixl"}}, "kv_connector"),
        ({"prefill_timeout_s": 0}, "prefill_timeout_s"),
    ],
)
def test_pd_args_refuse_what_cannot_work(change, message):
    from deployments.pd_config import PDServingArgs

    with pytest.raises(ValidationError, match=message):
        PDServingArgs.model_validate({"prefill_config": MINIMAL, "decode_config": MINIMAL, **change})


@pytest.mark.parametrize(
    "bad, key",
    [
        ({"request_limits": {"max_nn": 1}}, "max_nn"),
        ({"request_limits": {"max_n": 0}}, "max_n"),
        ({"request_limits": {"max_logprobs": 21}}, "max_logprobs"),
        ({"api_keys": [""]}, "api_keys"),
        ({"api_key": "k"}, "api_key"),
    ],
)
def test_server_options_in_the_args_refuse_unknown_keys_and_values_out_of_bounds(bad, key):
    with pytest.raises(ValidationError, match=key):
        LLMServingArgs.model_validate({"llm_configs": [MINIMAL], **bad})


def test_server_options_reach_the_ingress_of_both_builders():
    from deployments.app import build_openai_app, build_pd_openai_app
    from engine.entrypoints.openai.limits import RequestLimits
    from engine.entrypoints.openai.server_options import ServerOptions

    options = {"api_keys": ["k"], "metrics_require_api_key": True, "request_limits": {"max_n": 4}}
    expected = ServerOptions(api_keys=["k"], metrics_require_api_key=True, request_limits=RequestLimits(max_n=4))
    app = build_openai_app({"llm_configs": [MINIMAL], **options})
    pd_app = build_pd_openai_app({"prefill_config": MINIMAL, "decode_config": MINIMAL, **options})
    for built in (app, pd_app):
        assert built._bound_deployment.init_args[1] == expected  # OpenAiIngress(llm_servers, server_options)
    defaults = build_openai_app({"llm_configs": [MINIMAL]})._bound_deployment.init_args[1]
    assert defaults == ServerOptions() and defaults.api_keys == []


def test_a_relative_draft_checkpoint_resolves_against_the_checkout_like_model_source():
    config = LLMConfig(
        model_loading_config={"model_id": "m", "model_source": "assets/target"},
        engine_kwargs={"speculative_config": {"model": "assets/draft", "num_speculative_tokens": 2}},
    )
    args = config.engine_args()
    assert args.model == str(SERVAL_ROOT / "assets/target")
    assert args.speculative_config.model == str(SERVAL_ROOT / "assets/draft")
    assert args.speculative_config.method == "draft_model"
    with pytest.raises(ValidationError, match="num_speculative_tokens"):
        LLMConfig(model_loading_config={"model_id": "m"}, engine_kwargs={"speculative_config": {"method": "ngram"}})


@pytest.mark.parametrize(
    "args, message",
    [
        (
            {"llm_configs": [MINIMAL, {**MINIMAL, "model_loading_config": {"model_id": "b", "model_source": "x"}}]},
            "one model",
        ),
        ({"llm_configs": [MINIMAL], "ingress_deployment_config": {"num_replicas": 2}}, "ingress_deployment_config"),
        ({"llm_configs": [MINIMAL], "migration_limit": 2}, "migration_limit"),
    ],
)
def test_what_only_the_separate_ingress_does_is_refused_without_it(args, message):
    """With ``separate_ingress: false`` the LLM servers are the ingress: a second model, options for the
    OpenAiIngress, or a migration limit (it moves requests there) would be silently ignored; each is an error."""
    with pytest.raises(ValidationError, match=message):
        LLMServingArgs.model_validate({**args, "separate_ingress": False})
    assert LLMServingArgs.model_validate({"llm_configs": [MINIMAL], "migration_limit": 0, "separate_ingress": False})
