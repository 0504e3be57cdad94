"""``serval render-rayservice`` prints the chart's render; ``serval serve --print-config`` writes a Serve config
that validates and goes to the chart unchanged."""

from __future__ import annotations

import argparse

import helm_python  # the test extra installs helm-python-sdk (pyproject.toml)
import pytest
import yaml

from deployments.llm_config import SERVAL_ROOT, LLMServingArgs
from serval import serve_cmd
from serval.cli import main
from serval.engine_flags import engine_kwargs_from_flags
from tests.helm.chart import CHART_DIR, kuberay_errors, load_yaml, serve_config_errors

RAYSERVICE = "serval/templates/rayservice.yaml"


@pytest.fixture(scope="module")
def chart():
    with helm_python.Chart.load(CHART_DIR) as loaded:
        yield loaded


def cli_output(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize(
    "config, example",
    [
        ("default.yaml", None),
        ("default.yaml", "cpu-tiny.yaml"),
        ("gpu-llama-8b-tp2.yaml", "gpu-llama-8b-tp2.yaml"),
        ("pd.yaml", "pd.yaml"),
        ("gpu-two-models.yaml", "gpu-two-models.yaml"),
    ],
)
def test_render_rayservice_equals_the_charts_render(chart, capsys, config, example):
    config_path = SERVAL_ROOT / "configs/serve" / config
    argv = ["render-rayservice", str(config_path)]
    values = {"serveConfigFile": config_path.read_text()}  # what helm's --set-file serveConfigFile=... passes
    if example:
        argv += ["-f", str(CHART_DIR / "examples" / example)]
        values = {**load_yaml(CHART_DIR / "examples" / example), **values}
    expected = chart.render(values=values, name="serval", namespace="default")[RAYSERVICE].strip()
    assert cli_output(capsys, *argv) == f"---\n# Source: {RAYSERVICE}\n{expected}\n"


def test_render_rayservice_applies_set_after_files(chart, capsys):
    config_path = SERVAL_ROOT / "configs/serve/default.yaml"
    example = CHART_DIR / "examples" / "cpu-tiny.yaml"
    output = cli_output(
        capsys,
        "render-rayservice",
        str(config_path),
        "-f",
        str(example),
        "--set",
        "head.numCpus=1",
        "--set",
        "metrics.podMonitor.enabled=true",
        "--name",
        "demo",
        "--namespace",
        "llm",
        "--all",
    )
    values = {
        **load_yaml(example),
        "head": {"numCpus": 1},
        "metrics": {"podMonitor": {"enabled": True}},
        "serveConfigFile": config_path.read_text(),
    }
    expected = chart.render(values=values, name="demo", namespace="llm")
    documents = list(yaml.safe_load_all(output))
    assert [d["kind"] for d in documents] == ["PodMonitor", "RayService"]  # --all: every manifest, by path
    assert documents == [
        yaml.safe_load(expected[f"serval/templates/{name}.yaml"]) for name in ("podmonitor", "rayservice")
    ]
    assert documents[1]["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "1"
    assert kuberay_errors(documents[1]) == []


def test_render_rayservice_reports_bad_values(capsys, tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text("workerGroup: []\n")
    assert main(["render-rayservice", str(SERVAL_ROOT / "configs/serve/default.yaml"), "-f", str(values)]) == 1
    assert "'workerGroup' not allowed" in capsys.readouterr().err
    assert main(["render-rayservice", str(tmp_path / "missing.yaml")]) == 1
    assert "missing.yaml" in capsys.readouterr().err


def test_render_rayservice_refuses_a_mistyped_serve_config_in_one_line(capsys, tmp_path):
    """The Serve config is checked as its builder will check it in the cluster, before the chart renders."""
    config = load_yaml(SERVAL_ROOT / "configs/serve/default.yaml")
    config["applications"][0]["args"]["llm_configs"][0]["deployment_config"]["num_replica"] = 2
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump(config))
    assert main(["render-rayservice", str(tmp_path / "typo.yaml")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"serval render-rayservice: {tmp_path / 'typo.yaml'}: applications[0].args.llm_configs[0].deployment_config"
        ".num_replica: unknown key; did you mean num_replicas?\n"
    )


def test_serve_print_config_is_a_valid_serve_config(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a model directory (serval serve refuses anything else)
    output = cli_output(
        capsys,
        "serve",
        str(tmp_path),
        "--model-id",
        "my-model",
        "--tensor-parallel-size",
        "2",
        "--max-model-len",
        "1024",
        "--no-enable-prefix-caching",
        "--engine-kwargs",
        '{"block_size": 32}',
        "--num-replicas",
        "2",
        "--port",
        "8123",
        "--print-config",
    )
    config = yaml.safe_load(output)
    assert serve_config_errors(config) == []
    assert config["http_options"] == {"host": "127.0.0.1", "port": 8123}
    (llm_config,) = LLMServingArgs.model_validate(config["applications"][0]["args"]).llm_configs
    assert llm_config.model_id == "my-model"
    assert llm_config.model_loading_config.model_source == str(tmp_path)
    assert llm_config.engine_kwargs == {
        "block_size": 32,
        "max_model_len": 1024,
        "enable_prefix_caching": False,
        "tensor_parallel_size": 2,
    }
    assert llm_config.deployment_config.to_options()["num_replicas"] == 2


def test_serve_config_goes_to_the_chart_unchanged(chart, capsys, tmp_path):
    """The habit the two commands share: the file `serval serve` writes is what `helm install` takes."""
    path = tmp_path / "my-model.yaml"
    model = SERVAL_ROOT / "models" / "smollm2-135m-instruct"  # `make models` writes it
    path.write_text(cli_output(capsys, "serve", str(model), "--model-id", "m", "--print-config"))
    service = yaml.safe_load(cli_output(capsys, "render-rayservice", str(path)).split("\n", 2)[2])
    rendered = yaml.safe_load(service["spec"]["serveConfigV2"])
    # Inside the checkout the source is relative, so the chart moves it under the models mount.
    assert rendered["applications"][0]["args"]["llm_configs"][0]["model_loading_config"]["model_source"] == (
        "/models/smollm2-135m-instruct"
    )
    assert serve_config_errors(rendered) == [] and kuberay_errors(service) == []


def test_model_source_is_relative_inside_the_checkout_only(tmp_path):
    assert serve_cmd.model_source(str(SERVAL_ROOT / "models" / "smollm2-135m-instruct")) == (
        "models/smollm2-135m-instruct"
    )
    assert serve_cmd.model_source(str(SERVAL_ROOT / "models" / "smollm2-135m-instruct.gguf")) == (
        "models/smollm2-135m-instruct.gguf"
    )
    (tmp_path / "config.json").write_text("{}")
    assert serve_cmd.model_source(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match="not a model directory: it has no config.json"):
        serve_cmd.model_source(str(SERVAL_ROOT / "configs"))
    with pytest.raises(ValueError, match="does not exist"):
        serve_cmd.model_source(str(tmp_path / "missing"))


def test_a_hub_id_is_refused_with_the_way_to_fetch_it(capsys):
    assert main(["serve", "HuggingFaceTB/SmolLM2-135M-Instruct", "--print-config"]) == 1
    error = capsys.readouterr().err
    assert "never downloads" in error and "huggingface-cli download HuggingFaceTB/SmolLM2-135M-Instruct" in error


def test_a_gguf_file_is_served_under_its_name(capsys):
    output = cli_output(capsys, "serve", str(SERVAL_ROOT / "models" / "smollm2-135m-instruct.gguf"), "--print-config")
    (llm_config,) = yaml.safe_load(output)["applications"][0]["args"]["llm_configs"]
    assert llm_config["model_loading_config"] == {
        "model_id": "smollm2-135m-instruct",
        "model_source": "models/smollm2-135m-instruct.gguf",
    }


def test_serve_refuses_bad_engine_flags_naming_them(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    engine_kwargs = "serval serve: applications[0].args.llm_configs[0].engine_kwargs"
    assert main(["serve", str(tmp_path), "--max-num-seqs", "0", "--print-config"]) == 2
    assert capsys.readouterr().err == f"{engine_kwargs}.max_num_seqs: should be greater than or equal to 1, got 0\n"
    assert main(["serve", str(tmp_path), "--engine-kwargs", '{"max_num_seq": 8}', "--print-config"]) == 2
    assert capsys.readouterr().err == f"{engine_kwargs}.max_num_seq: unknown key; did you mean max_num_seqs?\n"


def test_every_engine_args_field_is_a_serve_flag():
    from engine.engine_args import EngineArgs

    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    flags = {action.dest for action in parser._actions}
    assert set(EngineArgs.model_fields) - {"model", "kv_transfer_config"} <= flags
    # Typed from the fields: an int, a --no- boolean, a tuple of ints; flags not given are not keys.
    args = parser.parse_args(
        ["m", "--max-num-seqs", "4", "--no-enable-prefix-caching", "--cuda-graph-batch-sizes", "1", "2"]
    )
    assert engine_kwargs_from_flags(args) == {
        "max_num_seqs": 4,
        "enable_prefix_caching": False,
        "cuda_graph_batch_sizes": [1, 2],
    }
