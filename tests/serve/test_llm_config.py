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


RAY_YAMLS = SERVAL_ROOT / "tests/serve/ray_serve_llm"  # Ray Serve LLM's documented examples, as published


def ray_example_args(name: str) -> dict:
    (app,) = yaml.safe_load((RAY_YAMLS / name).read_text())["applications"]
    return app["args"]


def test_rays_documented_examples_validate_unchanged():
    """Ray's quickstart configuration and its P/D example need no edit but the import path; the LoRA example's
    S3 adapters are refused with the reason (tests/serve/test_ray_serve_llm_yamls.py deploys all three)."""
    from deployments.pd_config import PDServingArgs

    quickstart = LLMServingArgs.model_validate(ray_example_args("quickstart.yaml"))
    assert [c.accelerator_type for c in quickstart.llm_configs] == ["A10G", "A10G"]
    pd = PDServingArgs.model_validate(ray_example_args("pd_nixl.yaml"))
    assert pd.kv_transfer_config.kv_connector == "object_store"  # Serval's stand-in for NixlConnector
    assert pd.with_role(pd.decode_config, "kv_consumer").engine_args().kv_transfer_config.kv_role == "kv_consumer"
    with pytest.raises(ValidationError, match="dynamic_lora_loading_path 's3://my_dynamic_lora_path': Serval loads"):
        LLMServingArgs.model_validate(ray_example_args("multi_lora.yaml"))
    lora_args = ray_example_args("multi_lora.yaml")
    lora_args["llm_configs"][0]["lora_config"]["dynamic_lora_loading_path"] = "models/tiny-llama-loras"
    engine_args = LLMServingArgs.model_validate(lora_args).llm_configs[0].engine_args()  # enable_lora beside it
    assert (engine_args.enable_lora, engine_args.max_loras, engine_args.max_cpu_loras) == (True, 16, 16)


def test_a_gpu_accelerator_type_means_cuda_and_its_resource():
    from deployments.app import server_options

    one = LLMConfig.model_validate({**MINIMAL, "accelerator_type": "A10"})  # Ray Serve LLM's alias of A10G
    assert one.engine_args().device == "cuda"
    assert server_options(one)["ray_actor_options"] == {"num_gpus": 1, "accelerator_type": "A10G"}
    tp = LLMConfig.model_validate({**MINIMAL, "accelerator_type": "H100", "engine_kwargs": {"tensor_parallel_size": 2}})
    bundles = server_options(tp)["placement_group_bundles"]
    assert bundles == [{"CPU": 2.0, "GPU": 1.0, "accelerator_type:H100": 0.001}, {"CPU": 1.0, "GPU": 1.0, **bundles[1]}]
    assert server_options(tp)["ray_actor_options"] == {}  # the workers hold the GPUs
    for bad, message in (
        ({"accelerator_type": "TPU-V4"}, "NVIDIA GPUs"),
        ({"accelerator_type": "X1"}, "Unknown accelerator_type"),
        ({"accelerator_type": "L4", "engine_kwargs": {"device": "cpu"}}, "device is cpu"),
    ):
        with pytest.raises(ValidationError, match=message):
            LLMConfig.model_validate({**MINIMAL, **bad})


def test_placement_group_config_gives_the_bundles_and_strategy_checked_against_tp_x_pp():
    from deployments.app import server_options

    two_stages = {"pipeline_parallel_size": 2}
    pg = {"bundles": [{"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 1}], "strategy": "SPREAD"}
    config = LLMConfig.model_validate({**MINIMAL, "engine_kwargs": two_stages, "placement_group_config": pg})
    options = server_options(config)
    assert options["placement_group_strategy"] == "SPREAD" and config.engine_args().device == "cuda"
    assert options["placement_group_bundles"] == [{"CPU": 2.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]
    assert config.engine_args().create_parallel_config().worker_resources == pg["bundles"]  # each takes its own
    one = LLMConfig.model_validate({**MINIMAL, "placement_group_config": {"bundle_per_worker": {"CPU": 1}}})
    assert one.engine_args().distributed_executor_backend == "ray"  # the engine's worker runs in the bundle
    # Ray Serve LLM's form on a 2-core node: the replica (Serve's 1 CPU) joins bundle 0, the worker takes 0.5.
    half = LLMConfig.model_validate({**MINIMAL, "placement_group_config": {"bundles": [{"CPU": 0.5}]}})
    assert half.engine_args().create_parallel_config().worker_resources == [{"CPU": 0.5}]
    assert server_options(half)["placement_group_bundles"] == [{"CPU": 1.5}]
    for bad, message in (
        ({"placement_group_config": pg}, "has 2 bundles; the engine has 1 workers"),
        (
            {"placement_group_config": {"bundles": [{"memory": 1e9}]}},
            r"placement_group_config.bundles\[0\] holds \{'memory': 1000000000.0\}; worker 0 .* needs CPU",
        ),
        (
            {"engine_kwargs": two_stages, "placement_group_config": {"bundles": [{"GPU": 1}, {"CPU": 4}]}},
            r"bundles\[1\] holds \{'CPU': 4.0\}; worker 1 .* needs GPU \(the engine runs on CUDA\)",
        ),
        (
            {"engine_kwargs": {"num_cpus_per_worker": 1}, "placement_group_config": {"bundles": [{"CPU": 0.5}]}},
            "each worker takes its bundle's CPUs",
        ),
        ({"engine_kwargs": {"worker_resources": [{"CPU": 1}]}}, "set placement_group_config's bundles"),
        ({"placement_group_config": {"bundles": [{"CPU": 1}], "strategy": "TIGHT"}}, "strategy"),
        ({"placement_group_config": {"bundles": [{"CPU": 1}], "bundle_per_worker": {"CPU": 1}}}, "either"),
        ({"deployment_config": {"placement_group_bundles": [{"CPU": 1}]}}, "placement_group_config"),
    ):
        with pytest.raises(ValidationError, match=message):
            LLMConfig.model_validate({**MINIMAL, **bad})


def test_every_serve_deployment_option_is_accepted_and_checked_by_serve():
    from deployments.app import build_openai_app, server_options

    options = {
        "name": "my-llm",
        "logging_config": {"log_level": "DEBUG"},
        "graceful_shutdown_wait_loop_s": 1.0,
        "max_queued_requests": 100,
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 3, "upscaling_factor": 2.0, "smoothing_factor": 1},
    }
    config = LLMConfig.model_validate({**MINIMAL, "deployment_config": options})
    assert config.server_deployment_name() == "my-llm"
    assert server_options(config)["autoscaling_config"]["upscaling_factor"] == 2.0
    assert "max_queued_requests" not in LLMConfig.model_validate(MINIMAL).deployment_config.to_options()  # Serve's
    for bad, message in (
        ({"autoscaling_config": {"max_replica": 3}}, r"deployment_config.autoscaling_config.max_replica"),
        ({"ray_actor_options": {"num_cpu": 1}}, "num_cpu"),
        ({"logging_config": {"log_levle": "INFO"}}, "log_levle"),
        ({"max_ongoing_requests": 0}, "max_ongoing_requests"),
    ):
        with pytest.raises(ValidationError, match=message):
            LLMConfig.model_validate({**MINIMAL, "deployment_config": bad})
    with pytest.raises(ValueError, match="reconfigure"):  # Serve would fail every replica's start on it
        build_openai_app({"llm_configs": [{**MINIMAL, "deployment_config": {"user_config": {"a": 1}}}]})


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"llm_engine": "vLLM"}, "own engine"),
        ({"model_loading_config": {"model_id": "m", "model_source": "s3://bucket/m"}}, "never downloads"),
        ({"model_loading_config": {"model_id": "m", "model_source": {"bucket_uri": "gs://b/m"}}}, "never downloads"),
        ({**MINIMAL, "engine_kwargs": {"enable_lora": False}, "lora_config": {}}, "contradicts lora_config"),
        ({**MINIMAL, "engine_kwargs": {"enable_lora": True}}, "needs a lora_config"),
        ({**MINIMAL, "engine_kwargs": {"tokenizer": "t"}}, "tokenizer_source"),
    ],
)
def test_what_serval_cannot_honour_gets_a_targeted_message(bad, message):
    with pytest.raises(ValidationError, match=message):
        LLMConfig.model_validate(bad)


def test_relative_paths_resolve_against_working_dir_then_the_cwd_then_the_checkout(tmp_path, monkeypatch):
    (tmp_path / "wd" / "models" / "tiny-llama").mkdir(parents=True)
    (tmp_path / "cwd" / "models" / "tiny-llama").mkdir(parents=True)
    (tmp_path / "cwd" / "tok").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    loading = {"model_id": "m", "model_source": "models/tiny-llama", "tokenizer_source": "tok"}
    in_wd = LLMConfig.model_validate({"model_loading_config": loading, "runtime_env": {"working_dir": "../wd"}})
    assert in_wd.engine_args().model == str(tmp_path / "wd" / "models" / "tiny-llama")
    assert in_wd.engine_args().tokenizer == str(tmp_path / "cwd" / "tok")
    in_cwd = LLMConfig.model_validate({"model_loading_config": loading})
    assert in_cwd.model_loading_config.resolved_source() == str(tmp_path / "cwd" / "models" / "tiny-llama")
    monkeypatch.chdir(tmp_path)
    spec = LLMConfig.model_validate({"model_loading_config": {**loading, "model_source": "configs/serve"}})
    assert spec.model_loading_config.resolved_source() == str(SERVAL_ROOT / "configs/serve")


def test_serval_serve_is_the_builders_module_under_servals_name():
    import deployments.app
    import serval.serve

    assert serval.serve.build_openai_app is deployments.app.build_openai_app
    assert serval.serve.build_pd_openai_app is deployments.app.build_pd_openai_app
