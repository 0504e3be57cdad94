"""The chart's config is a config that runs: the serveConfigV2 rendered for the CPU example, its model
path pointed at a local checkpoint, deploys on a local Ray cluster (the launcher, as `make serve`) and
answers a completion; and `serval serve <model dir>` deploys its own config on the same head."""

from __future__ import annotations

import helm_python  # the test extra installs helm-python-sdk (pyproject.toml)
import openai
import pytest

from tests.helm.chart import CHART_DIR, load_yaml, rayservice, serve_config_of
from tests.helm.local_head import start_head, stop_head
from tests.serve.cluster import LOOPBACK, deploy_and_wait, is_loopback, listening_addresses

# This module starts its own Ray head: tests/serve's session-wide ray_head is a fixture of that package's
# conftest, and importing it here would make a second session instance (two clusters, two ray.init).
pytestmark = [pytest.mark.ray, pytest.mark.serve]
# The CPU example's model (configs/serve/default.yaml's): served here from the tiny checkpoint, under its name.
EXAMPLE_MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def head():
    started = start_head()
    try:
        yield started
    finally:
        stop_head(started)


@pytest.fixture(scope="module")
def chart_config(head, tiny_checkpoint, tmp_path_factory):
    """The CPU example's rendered Serve config: on loopback, its models mount a directory holding the
    local checkpoint under the example's name (models/smollm2-135m-instruct -> <mount>/smollm2-135m-instruct)."""
    mount = tmp_path_factory.mktemp("models")
    (mount / EXAMPLE_MODEL).symlink_to(tiny_checkpoint("llama"))
    values = {
        **load_yaml(CHART_DIR / "examples" / "cpu-tiny.yaml"),
        "serve": {"host": LOOPBACK, "port": head.http_port},
        "models": {"mountPath": str(mount)},
    }
    with helm_python.Chart.load(CHART_DIR) as chart:
        config = serve_config_of(rayservice(chart, values))
    (llm_config,) = config["applications"][0]["args"]["llm_configs"]
    assert llm_config["model_loading_config"]["model_source"] == f"{mount}/{EXAMPLE_MODEL}"
    return config


def test_the_cpu_examples_serve_config_deploys_and_answers_a_completion(head, chart_config):
    deploy_and_wait(head, chart_config)
    client = openai.OpenAI(base_url=f"{head.base_url}/v1", api_key="none", max_retries=0, timeout=120)
    assert [model.id for model in client.models.list()] == [EXAMPLE_MODEL]
    response = client.completions.create(
        model=EXAMPLE_MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == 8
    assert response.choices[0].text
    exposed = {(a, p) for a, p in listening_addresses() - head.listeners_before if not is_loopback(a)}
    assert not exposed, f"sockets listening beyond loopback: {exposed}"


def test_serval_serve_deploys_its_config_the_way_make_serve_does(head, tiny_checkpoint, tmp_path):
    """`serval serve <model dir> --detach` finds the running head (as `make serve` does), replaces the app of the
    same name there, deploys and waits."""
    from serval.cli import main

    config_path = tmp_path / "served.yaml"
    assert (
        main(
            [
                "serve",
                tiny_checkpoint("llama"),
                "--model-id",
                "served-by-cli",
                "--max-model-len",
                "512",
                "--num-cpus-per-replica",
                "0.5",
                "--port",
                str(head.http_port),
                "--dashboard-port",
                str(head.dashboard_port),
                "--gcs-port",
                str(head.gcs_port),
                "--timeout-s",
                "300",
                "--output",
                str(config_path),
                "--detach",  # return once RUNNING (a joined cluster: the app stays when this returns)
                "--replace",  # the previous test's app `llm` runs on this head
            ]
        )
        == 0
    )
    assert load_yaml(config_path)["applications"][0]["args"]["llm_configs"][0]["engine_kwargs"] == {
        "max_model_len": 512
    }
    client = openai.OpenAI(base_url=f"{head.base_url}/v1", api_key="none", max_retries=0, timeout=120)
    assert [model.id for model in client.models.list()] == ["served-by-cli"]
    response = client.completions.create(
        model="served-by-cli", prompt="Hello", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert response.usage.completion_tokens == 4
