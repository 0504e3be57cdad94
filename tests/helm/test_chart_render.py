"""The chart under real Helm: lint is clean, the defaults and every example render to a RayService that
KubeRay's CRD schema accepts strictly, whose serveConfigV2 Ray Serve and Serval accept, with the GPUs
its engines need."""

from __future__ import annotations

import json
import tomllib

import helm_python  # the test extra installs helm-python-sdk (pyproject.toml)
import pytest
import yaml

from deployments.llm_config import SERVAL_ROOT
from tests.helm.chart import (
    CHART_DIR,
    CRD_SCHEMA,
    EXAMPLES,
    SHARED_CRD_SCHEMA,
    gpus_needed,
    kuberay_errors,
    load_yaml,
    pods,
    rayservice,
    serve_config_errors,
    serve_config_of,
)

# Examples -> the shipped Serve config each one carries unchanged.
EXAMPLE_SERVE_CONFIGS = {
    "cpu-tiny.yaml": "default.yaml",
    "gpu-llama-8b-tp2.yaml": "gpu-llama-8b-tp2.yaml",
    "pd.yaml": "pd.yaml",
    "gpu-two-models.yaml": "gpu-two-models.yaml",
}
VALUE_SETS = [pytest.param(None, id="defaults"), *(pytest.param(p, id=p.stem) for p in EXAMPLES)]


@pytest.fixture(scope="module")
def chart():
    with helm_python.Chart.load(CHART_DIR) as loaded:
        yield loaded


def values_of(path) -> dict | None:
    return None if path is None else load_yaml(path)


@pytest.mark.parametrize("path", VALUE_SETS)
def test_lint_is_clean(path):
    report = helm_python.lint(CHART_DIR, values_of(path), strict=True)
    assert report["errors"] == []
    # Severity 1 is informational (Helm's "icon is recommended"); 2 and 3 are warnings and errors.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_chart_metadata_is_servals(chart):
    with open(SERVAL_ROOT / "pyproject.toml", "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    assert chart.metadata["apiVersion"] == "v2"
    assert chart.metadata["appVersion"] == version
    assert (
        rayservice(chart)["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
        == f"serval:{version}"
    )


def test_every_example_is_listed_with_its_serve_config():
    assert sorted(p.name for p in EXAMPLES) == sorted(EXAMPLE_SERVE_CONFIGS)


@pytest.mark.parametrize("example, config", EXAMPLE_SERVE_CONFIGS.items())
def test_examples_carry_the_shipped_serve_configs_unchanged(example, config):
    """One file runs locally (make serve, serve deploy) and on a cluster (helm install)."""
    assert load_yaml(CHART_DIR / "examples" / example)["serveConfig"] == load_yaml(
        SERVAL_ROOT / "configs/serve" / config
    )


@pytest.mark.parametrize("path", VALUE_SETS)
def test_rendered_rayservice_meets_kuberays_crd_schema_strictly(chart, path):
    service = rayservice(chart, values_of(path))
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    assert kuberay_errors(service) == []


def test_the_strict_schema_refuses_unknown_fields(chart):
    """The check above can fail: an unknown field anywhere in the spec is an error."""
    service = rayservice(chart)
    service["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}
    pods(service)[1]["spec"]["containers"][0]["resource"] = {}
    errors = kuberay_errors(service)
    assert any("rayStartParam" in e for e in errors) and any("'resource'" in e for e in errors), errors


def test_vendored_crd_schema_is_kuberays():
    if not SHARED_CRD_SCHEMA.exists():
        pytest.skip(f"no shared copy at {SHARED_CRD_SCHEMA}")
    assert json.loads(CRD_SCHEMA.read_text()) == json.loads(SHARED_CRD_SCHEMA.read_text())


@pytest.mark.parametrize("path", VALUE_SETS)
def test_rendered_serve_config_is_valid_for_ray_serve_and_serval(chart, path):
    config = serve_config_of(rayservice(chart, values_of(path)))
    assert serve_config_errors(config) == []
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000}  # the Serve Service reaches the pod


def test_serve_config_errors_can_fail():
    config = load_yaml(SERVAL_ROOT / "configs/serve/default.yaml")
    config["applications"][0]["args"]["llm_configs"][0]["engine_kwargs"]["max_num_seq"] = 8
    assert "max_num_seq" in serve_config_errors(config)[0]
    assert "applications" in serve_config_errors({"applications": "llm"})[0]


def test_defaults_serve_default_yaml_with_the_charts_two_changes(chart):
    """http_options from values.serve, relative model sources under the models mount; nothing else."""
    expected = load_yaml(SERVAL_ROOT / "configs/serve/default.yaml")
    expected["http_options"] = {"host": "0.0.0.0", "port": 8000}
    expected["applications"][0]["args"]["llm_configs"][0]["model_loading_config"]["model_source"] = (
        "/models/smollm2-135m-instruct"
    )
    assert serve_config_of(rayservice(chart)) == expected


@pytest.mark.parametrize("path", [p for p in EXAMPLES if p.stem.startswith("gpu-")], ids=lambda p: p.stem)
def test_gpu_examples_request_the_gpus_their_engines_need(chart, path):
    service = rayservice(chart, values_of(path))
    at_start, at_most, per_replica = gpus_needed(serve_config_of(service))
    groups = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    gpus_per_pod = [
        int(g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0)) for g in groups
    ]
    assert per_replica >= 1
    # A replica's tensor-parallel group shares one pod (STRICT_PACK), so some pod holds a whole replica.
    assert max(gpus_per_pod) >= per_replica
    assert sum(g["replicas"] * n for g, n in zip(groups, gpus_per_pod)) >= at_start
    assert sum(g["maxReplicas"] * n for g, n in zip(groups, gpus_per_pod)) >= at_most
    for group in groups:
        resources = group["template"]["spec"]["containers"][0]["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"]
        assert {"cpu", "memory"} <= set(resources["requests"]) and {"cpu", "memory"} <= set(resources["limits"])


def test_gpus_needed_counts_tp_workers_and_overrides():
    assert gpus_needed(load_yaml(SERVAL_ROOT / "configs/serve/gpu-llama-8b-tp2.yaml")) == (4, 8, 2)
    assert gpus_needed(load_yaml(SERVAL_ROOT / "configs/serve/gpu-two-models.yaml")) == (4, 4, 1)
    assert gpus_needed(load_yaml(SERVAL_ROOT / "configs/serve/default.yaml")) == (0, 0, 0)


def test_serve_config_file_renders_as_the_same_map(chart):
    """--set-file serveConfigFile=<file> and the file's map as serveConfig are one config."""
    path = SERVAL_ROOT / "configs/serve/pd.yaml"
    from_file = rayservice(chart, {"serveConfigFile": path.read_text()})
    assert from_file == rayservice(chart, {"serveConfig": load_yaml(path)})
    assert yaml.safe_load(from_file["spec"]["serveConfigV2"])["applications"][0]["import_path"] == (
        "deployments.app:build_pd_openai_app"
    )


def test_packaged_chart_renders_the_same(chart, tmp_path):
    """configs/default.yaml and dashboards/serval.json are symlinks into the repository: `helm package`
    must carry their contents."""
    archive = helm_python.package(CHART_DIR, destination=tmp_path)
    values = {"metrics": {"grafanaDashboard": {"enabled": True}}}
    with helm_python.Chart.load(archive) as packaged:
        assert packaged.render(values=values, name="serval") == chart.render(values=values, name="serval")
