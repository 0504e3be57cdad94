"""A mistyped serve config is refused in one line (issue 59): the key's YAML path, what is wrong, the nearest
valid key; the same check in ``serval serve`` (before any Ray head starts) and in the app builders (where
Serve builds the app: that path on a cluster is tests/serve/test_scaling.py's DEPLOY_FAILED test).

No cluster here: the checks are ``deployments.serve_config`` and ``deployments.config_errors``, and one
``serval serve --config`` subprocess that must exit before it could start anything.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from ray.serve.exceptions import RayServeException

from deployments.app import build_openai_app, build_pd_openai_app
from deployments.config_errors import ConfigError
from deployments.serve_config import check_serve_config
from serval.cli import main
from serval.launcher import processes
from serval.launcher.head import free_port

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = yaml.safe_load((ROOT / "configs/serve/default.yaml").read_text())
LLM = "applications[0].args.llm_configs[0]"
RAY_PROCESSES = ("raylet", "gcs_server")
REFUSAL_BUDGET_S = 5.0  # the bar: a refused config answers in under 5 s


def with_llm_config(change) -> dict:
    """configs/serve/default.yaml with ``change`` applied to its (only) LLM config."""
    config = copy.deepcopy(DEFAULT)
    change(config["applications"][0]["args"]["llm_configs"][0])
    return config


def refusal(config: dict) -> str:
    with pytest.raises(ConfigError) as refused:
        check_serve_config(config)
    line = str(refused.value)
    assert "\n" not in line and "function-after" not in line and "valid string" not in line, line
    return line


@pytest.mark.parametrize(
    "change, line",
    [
        (
            lambda c: c["engine_kwargs"].update(max_num_seq=8),
            f"{LLM}.engine_kwargs.max_num_seq: unknown key; did you mean max_num_seqs?",
        ),
        (
            lambda c: c["deployment_config"].update(num_replica=2),
            f"{LLM}.deployment_config.num_replica: unknown key; did you mean num_replicas?",
        ),
        (  # a key of Serve's own nested model, which Serve itself would drop without a word
            lambda c: c["deployment_config"].update(autoscaling_config={"min_replica": 1, "max_replicas": 2}),
            f"{LLM}.deployment_config.autoscaling_config.min_replica: unknown key; did you mean min_replicas?",
        ),
        (
            lambda c: c.update(lora_config={"max_num_adapter_per_replica": 4}),
            f"{LLM}.lora_config.max_num_adapter_per_replica: unknown key; did you mean max_num_adapters_per_replica?",
        ),
        (lambda c: c.update(engine_kwarg={}), f"{LLM}.engine_kwarg: unknown key; did you mean engine_kwargs?"),
        (
            lambda c: c["engine_kwargs"].update(speculative_config={"methd": "ngram"}),  # before "method: missing"
            f"{LLM}.engine_kwargs.speculative_config.methd: unknown key; did you mean method?",
        ),
    ],
)
def test_a_typo_is_named_with_the_nearest_valid_key(change, line):
    assert refusal(with_llm_config(change)) == line


def test_an_unknown_key_with_no_close_one_says_where_the_valid_ones_are():
    line = refusal(with_llm_config(lambda c: c["engine_kwargs"].update(xyzzy_plugh=1)))
    assert line.startswith(f"{LLM}.engine_kwargs.xyzzy_plugh: unknown key (none of the ")
    assert line.endswith("valid keys is close; they are EngineArgs' fields: `serval serve --help` lists them as flags)")
    assert refusal(with_llm_config(lambda c: c.update(tokenizer="x"))) == (
        f"{LLM}.tokenizer: unknown key (valid: model_loading_config, engine_kwargs, lora_config, deployment_config, "
        "runtime_env, accelerator_type, placement_group_config)"
    )


def test_a_wrong_type_names_the_expected_type_and_the_value_given():
    assert refusal(with_llm_config(lambda c: c["engine_kwargs"].update(max_num_seqs="many"))) == (
        f"{LLM}.engine_kwargs.max_num_seqs: expected an integer, got 'many'"
    )
    assert refusal(with_llm_config(lambda c: c.update(engine_kwargs=[]))) == (
        f"{LLM}.engine_kwargs: expected a mapping, got []"
    )
    assert refusal(with_llm_config(lambda c: c["engine_kwargs"].update(dtype="flot16"))) == (
        f"{LLM}.engine_kwargs.dtype: should be 'auto', 'float32', 'bfloat16' or 'float16', got 'flot16'; "
        "did you mean float16?"
    )
    # An LLM config may be a mapping or a YAML file's path: a value that is neither names both.
    config = copy.deepcopy(DEFAULT)
    config["applications"][0]["args"]["llm_configs"] = [5]
    assert refusal(config) == f"{LLM}: expected a mapping or a string, got 5"


def test_a_key_serves_own_schema_would_drop_is_refused_too():
    typo = {**copy.deepcopy(DEFAULT), "http_option": {"port": 9000}}
    assert refusal(typo) == "http_option: unknown key; did you mean http_options?"
    typo = copy.deepcopy(DEFAULT)
    typo["applications"][0]["route_prefx"] = "/v2"
    assert refusal(typo) == "applications[0].route_prefx: unknown key; did you mean route_prefix?"


def test_a_bundle_its_worker_cannot_run_in_is_refused_with_what_it_holds_and_needs():
    """Issue 58: refused where the config is built, before anything is scheduled (no replica left pending)."""
    no_cpu = with_llm_config(lambda c: c.update(placement_group_config={"bundles": [{"memory": 1e9}]}))
    assert refusal(no_cpu) == (
        f"{LLM}: placement_group_config.bundles[0] holds {{'memory': 1000000000.0}}; worker 0 takes its "
        "resources from it and needs CPU (its torch threads run on them)."
    )


def test_an_llm_config_file_names_itself_and_the_keys_path_in_it(tmp_path):
    model = tmp_path / "model.yaml"
    model.write_text(yaml.safe_dump({"model_loading_config": {"model_id": "m"}, "engine_kwargs": {"max_num_seq": 8}}))
    config = copy.deepcopy(DEFAULT)
    config["applications"][0]["args"]["llm_configs"] = [str(model)]
    assert refusal(config) == f"{LLM}: {model}: engine_kwargs.max_num_seq: unknown key; did you mean max_num_seqs?"
    config["applications"][0]["args"]["llm_configs"] = [str(tmp_path / "absent.yaml")]
    assert refusal(config).startswith(f"{LLM}: {tmp_path / 'absent.yaml'}: [Errno 2] No such file or directory")


def test_serves_own_schema_and_validators_messages_keep_their_place():
    config = copy.deepcopy(DEFAULT)
    config["http_options"]["port"] = "eighty"
    assert refusal(config) == "http_options.port: expected an integer, got 'eighty'"
    assert refusal(with_llm_config(lambda c: c.update(llm_engine="vLLM"))) == (
        f"{LLM}: llm_engine: Serval serves with its own engine (engine/); leave llm_engine out."
    )
    assert refusal(with_llm_config(lambda c: c["deployment_config"].update(max_ongoing_requests=0))) == (
        f"{LLM}.deployment_config.max_ongoing_requests: should be greater than 0, got 0"
    )


def test_other_apps_args_are_left_to_their_builders_and_the_shipped_configs_pass():
    config = copy.deepcopy(DEFAULT)
    config["applications"][0]["import_path"] = "my_app:build"
    config["applications"][0]["args"] = {"anything": 1}
    check_serve_config(config)
    for path in sorted((ROOT / "configs/serve").glob("*.yaml")):
        check_serve_config(yaml.safe_load(path.read_text()))


def test_the_builders_raise_the_same_line_for_serves_status():
    """Serve reports a ``RayServeException``'s message alone (no traceback) as the app's DEPLOY_FAILED message;
    the builder does not know the app's place in the file, so its path starts at ``args``."""
    args = with_llm_config(lambda c: c["engine_kwargs"].update(max_num_seq=8))["applications"][0]["args"]
    with pytest.raises(RayServeException) as refused:
        build_openai_app(args)
    assert isinstance(refused.value, ValueError)
    assert (
        str(refused.value) == "args.llm_configs[0].engine_kwargs.max_num_seq: unknown key; did you mean max_num_seqs?"
    )
    pd = yaml.safe_load((ROOT / "configs/serve/pd.yaml").read_text())["applications"][0]["args"]
    pd["prefill_config"]["engine_kwargs"]["block_sise"] = 16
    with pytest.raises(ConfigError, match=r"^args\.prefill_config\.engine_kwargs\.block_sise: unknown key; did you me"):
        build_pd_openai_app(pd)


def test_debug_adds_pydantics_report(capsys, tmp_path):
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump(with_llm_config(lambda c: c["engine_kwargs"].update(max_num_seq=8))))
    assert main(["--debug", "serve", "--config", str(typo), "--print-config"]) == 2
    captured = capsys.readouterr()
    assert "validation errors for LLMServingArgs" in captured.err and captured.out == ""
    assert captured.err.splitlines()[-1].endswith("engine_kwargs.max_num_seq: unknown key; did you mean max_num_seqs?")


def ray_processes_of(gcs_port: int) -> list[str]:
    """The command lines of raylet / gcs_server processes naming ``gcs_port``: a head started for the command
    would (other people's clusters may run on this machine, on other ports)."""
    found = []
    for process in psutil.process_iter(["name", "cmdline"]):
        command = " ".join(process.info["cmdline"] or [])
        if any(name in (process.info["name"] or "") for name in RAY_PROCESSES) and str(gcs_port) in command:
            found.append(command)
    return found


def test_serval_serve_refuses_a_typo_in_one_line_before_any_ray_head_starts(tmp_path):
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump(with_llm_config(lambda c: c["engine_kwargs"].update(max_num_seq=8))))
    gcs_port, dashboard_port = free_port(), free_port()
    command = [sys.executable, "-m", "serval", "serve", "--config", "typo.yaml", "--detach"]
    ports = ["--gcs-port", str(gcs_port), "--dashboard-port", str(dashboard_port)]
    environment = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    environment.update(PYTHONPATH=str(ROOT), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    started = time.monotonic()
    try:
        result = subprocess.run(
            [*command, *ports], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=120
        )
        elapsed = time.monotonic() - started
    finally:
        left = ray_processes_of(gcs_port)
        processes.stop_head(gcs_port)  # were the check gone, a head would be up: stop it, and fail below
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        f"serval serve: typo.yaml: {LLM}.engine_kwargs.max_num_seq: unknown key; did you mean max_num_seqs?\n"
    )
    assert result.stdout == ""
    assert elapsed < REFUSAL_BUDGET_S, f"refused after {elapsed:.1f} s"
    assert left == []
