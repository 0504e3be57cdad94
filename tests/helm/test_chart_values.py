"""What the chart's values do (head, autoscaler, env, models, observability, security) and what they refuse."""

from __future__ import annotations

import json

import helm_python  # the test extra installs helm-python-sdk (pyproject.toml)
import pytest

from deployments.llm_config import SERVAL_ROOT
from tests.helm.chart import CHART_DIR, kuberay_errors, load_yaml, pods, rayservice, render, serve_config_of

GPU_EXAMPLE = CHART_DIR / "examples" / "gpu-llama-8b-tp2.yaml"
MAKE_SERVE_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}


@pytest.fixture(scope="module")
def chart():
    with helm_python.Chart.load(CHART_DIR) as loaded:
        yield loaded


def cluster_of(service: dict) -> dict:
    return service["spec"]["rayClusterConfig"]


def container_env(pod: dict) -> dict[str, str]:
    return {item["name"]: item.get("value") for item in pod["spec"]["containers"][0]["env"]}


def test_gpu_clusters_keep_replicas_off_the_head(chart):
    gpu = cluster_of(rayservice(chart, load_yaml(GPU_EXAMPLE)))
    assert gpu["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert "num-cpus" not in cluster_of(rayservice(chart))["headGroupSpec"]["rayStartParams"]
    pinned = cluster_of(rayservice(chart, {**load_yaml(GPU_EXAMPLE), "head": {"numCpus": 1}}))
    assert pinned["headGroupSpec"]["rayStartParams"]["num-cpus"] == "1"


def test_head_exposes_ray_and_serve_ports_inside_the_cluster_only(chart):
    head = cluster_of(rayservice(chart))["headGroupSpec"]
    ports = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert ports == {"gcs-server": 6379, "dashboard": 8265, "client": 10001, "serve": 8000, "metrics": 8080}
    assert head["serviceType"] == "ClusterIP" and not head.get("enableIngress")
    assert head["rayStartParams"]["metrics-export-port"] == "8080"


def test_worker_groups_are_explicit(chart):
    (group,) = cluster_of(rayservice(chart, load_yaml(GPU_EXAMPLE)))["workerGroupSpecs"]
    assert (group["groupName"], group["replicas"], group["minReplicas"], group["maxReplicas"]) == ("gpu-tp2", 2, 2, 4)
    resources = group["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"] == {"cpu": "8", "memory": "48Gi", "nvidia.com/gpu": 2}
    assert group["rayStartParams"]["metrics-export-port"] == "8080"


def test_autoscaler_runs_when_serve_autoscales_or_when_asked(chart):
    gpu = cluster_of(rayservice(chart, load_yaml(GPU_EXAMPLE)))
    assert gpu["enableInTreeAutoscaling"] is True
    assert gpu["autoscalerOptions"]["upscalingMode"] == "Default"
    assert cluster_of(rayservice(chart))["enableInTreeAutoscaling"] is False
    forced_on = cluster_of(rayservice(chart, {"autoscaler": {"enabled": True}}))
    assert forced_on["enableInTreeAutoscaling"] is True and "autoscalerOptions" in forced_on
    forced_off = cluster_of(rayservice(chart, {**load_yaml(GPU_EXAMPLE), "autoscaler": {"enabled": False}}))
    assert forced_off["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in forced_off


def test_every_pod_gets_the_env_make_serve_sets_and_token_auth(chart):
    service = rayservice(chart, load_yaml(GPU_EXAMPLE))
    for pod in pods(service):
        assert MAKE_SERVE_ENV.items() <= container_env(pod).items()
    assert cluster_of(service)["authOptions"] == {"mode": "token"}
    plain = rayservice(chart, {"ray": {"haproxy": False, "auth": "disabled", "env": [{"name": "X", "value": "1"}]}})
    assert "authOptions" not in cluster_of(plain)
    for pod in pods(plain):
        env = container_env(pod)
        assert "RAY_SERVE_ENABLE_HA_PROXY" not in env and env["X"] == "1"
    assert kuberay_errors(plain) == []


@pytest.mark.parametrize(
    "models, volume",
    [
        (
            {"persistentVolumeClaim": {"claimName": "llm-models"}},
            {"persistentVolumeClaim": {"claimName": "llm-models", "readOnly": True}},
        ),
        ({"hostPath": {"path": "/mnt/models"}}, {"hostPath": {"path": "/mnt/models", "type": "Directory"}}),
    ],
)
def test_models_volume_is_mounted_read_only_on_every_pod(chart, models, volume):
    service = rayservice(chart, {"models": models})
    assert kuberay_errors(service) == []
    for pod in pods(service):
        (found,) = [v for v in pod["spec"]["volumes"] if v["name"] == "models"]
        assert found == {"name": "models", **volume}
        mounts = {m["name"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
        assert mounts["models"] == {"name": "models", "mountPath": "/models", "readOnly": True}


def test_no_models_volume_unless_one_is_given(chart):
    for pod in pods(rayservice(chart)):
        assert "models" not in {v["name"] for v in pod["spec"]["volumes"]}


def test_relative_model_sources_move_under_the_mount_and_absolute_ones_stay(chart):
    llm_configs = [
        {"model_loading_config": {"model_id": "a", "model_source": "models/a"}},
        {"model_loading_config": {"model_id": "b"}},
        {"model_loading_config": {"model_id": "c", "model_source": "/data/c"}},
        {"model_loading_config": {"model_id": "d", "model_source": "ckpt/d"}},
    ]
    config = {
        "applications": [
            {"name": "llm", "import_path": "deployments.app:build_openai_app", "args": {"llm_configs": llm_configs}}
        ]
    }
    values = {"serveConfig": config, "models": {"mountPath": "/weights"}}
    rendered = serve_config_of(rayservice(chart, values))["applications"][0]["args"]["llm_configs"]
    assert [c["model_loading_config"]["model_source"] for c in rendered] == [
        "/weights/a",
        "/weights/b",
        "/data/c",
        "/weights/ckpt/d",
    ]
    kept = serve_config_of(rayservice(chart, {**values, "models": {"rewriteRelativeSources": False}}))
    assert kept["applications"][0]["args"]["llm_configs"] == llm_configs
    pd = serve_config_of(rayservice(chart, {"serveConfig": load_yaml(SERVAL_ROOT / "configs/serve/pd.yaml")}))
    args = pd["applications"][0]["args"]
    assert {args[k]["model_loading_config"]["model_source"] for k in ("prefill_config", "decode_config")} == {
        "/models/tiny-llama"
    }


def test_pod_monitor_scrapes_the_metrics_port_of_the_charts_pods(chart):
    assert "PodMonitor" not in render(chart)
    manifests = render(chart, {"metrics": {"podMonitor": {"enabled": True, "labels": {"release": "prom"}}}})
    (monitor,) = manifests["PodMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["podMetricsEndpoints"] == [{"port": "metrics", "interval": "15s"}]
    for pod in pods(manifests["RayService"][0]):
        assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        assert "metrics" in {p["name"] for p in pod["spec"]["containers"][0]["ports"]}


def test_grafana_dashboard_configmap_is_servals_dashboard(chart):
    assert "ConfigMap" not in render(chart)
    (config_map,) = render(chart, {"metrics": {"grafanaDashboard": {"enabled": True}}})["ConfigMap"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    packaged = json.loads((SERVAL_ROOT / "serval/dashboards/serval.json").read_text())
    assert json.loads(config_map["data"]["serval.json"]) == packaged


def test_pods_run_unprivileged(chart):
    for pod in pods(rayservice(chart, load_yaml(GPU_EXAMPLE))):
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        container = pod["spec"]["containers"][0]["securityContext"]
        assert container["allowPrivilegeEscalation"] is False and container["capabilities"] == {"drop": ["ALL"]}


def test_notes_say_how_to_reach_the_endpoint(chart):
    (notes,) = render(chart, name="demo")["NOTES"]
    assert "kubectl port-forward -n llm svc/demo-serval-serve-svc 8000:8000" in notes
    assert '"model": "smollm2-135m-instruct"' in notes


@pytest.mark.parametrize(
    "values, message",
    [
        ({"replicas": 2}, "additional properties 'replicas' not allowed"),
        ({"image": {"tag": 1}}, "/image/tag"),
        (
            {"workerGroups": [{"name": "g", "replicas": "two", "minReplicas": 0, "maxReplicas": 1}]},
            "/workerGroups/0/replicas",
        ),
        (
            {"workerGroups": [{"name": "g", "replicas": 1, "minReplicas": 0, "maxReplicas": 1, "gpu": 1}]},
            "'gpu' not allowed",
        ),
        ({"workerGroups": [{"name": "g", "replicas": 1, "minReplicas": 0, "maxReplicas": 1, "gpus": -1}]}, "/gpus"),
        (
            {"workerGroups": [{"name": "g", "replicas": 3, "minReplicas": 0, "maxReplicas": 2}]},
            "minReplicas <= replicas",
        ),
        ({"workerGroups": []}, "/workerGroups"),
        ({"ray": {"auth": "password"}}, "/ray/auth"),
        ({"head": {"rayStartParams": {"num-cpus": 0}}}, "/head/rayStartParams/num-cpus"),
        ({"serveConfig": {"applications": []}}, "/serveConfig/applications"),
        ({"serveConfig": {"proxy_location": "HeadOnly"}}, "needs an applications list"),
        ({"serveConfigFile": "applications: [1"}, "serveConfigFile is not a YAML map"),
        ({"models": {"mountPath": "models"}}, "/models/mountPath"),
    ],
)
def test_bad_values_are_refused_naming_the_key(chart, values, message):
    with pytest.raises(helm_python.HelmError, match=message.replace("(", r"\(")) as caught:
        chart.render(values=values, name="serval")
    assert isinstance(caught.value, (helm_python.HelmValuesError, helm_python.HelmRenderError))
