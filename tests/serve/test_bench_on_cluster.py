"""`serval bench` against a live app on a real Ray cluster: a load test submitted as a Ray Job, and
`serval bench tune`'s 2x2 sweep, which redeploys the app per point and picks the best one."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from serval.cli import main as serval_main
from serval.launcher import lifecycle as launcher
from tests.serve.cluster import app_status, deploy_and_wait, llm_config, serve_config

ROOT = Path(__file__).resolve().parents[2]
LLAMA = "tiny-llama"
ORIGINAL_MAX_NUM_SEQS = 64


@pytest.fixture(scope="module")
def deployed_config(ray_head, tiny_checkpoint) -> dict:
    config = serve_config(
        ray_head.http_port, [llm_config(LLAMA, tiny_checkpoint("llama"), max_num_seqs=ORIGINAL_MAX_NUM_SEQS)]
    )
    deploy_and_wait(ray_head, config)
    return config


def test_a_load_test_runs_as_a_ray_job(ray_head, deployed_config, tiny_checkpoint, tmp_path):
    """What the README tells users: `ray job submit --working-dir . -- serval bench serve ...`."""
    command = [
        launcher.ray_bin("ray"),
        "job",
        "submit",
        "--address",
        ray_head.dashboard_url,
        "--working-dir",
        str(ROOT),
        "--",
        "serval",
        "bench",
        "serve",
        "--base-url",
        ray_head.base_url,
        "--model",
        LLAMA,
        "--tokenizer",
        tiny_checkpoint("llama"),
        "--num-prompts",
        "8",
        "--random-input-len",
        "32",
        "--random-output-len",
        "8",
        "--disable-tqdm",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "job.json",
    ]
    for _ in range(3):  # Ray's job server answers "No available agent ... try again later" while its agent is busy
        job = subprocess.run(command, env=launcher.ray_env(), capture_output=True, text=True, timeout=300)
        if "No available agent to submit job" not in job.stderr:
            break
        time.sleep(5)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert "succeeded" in job.stdout + job.stderr and "Serving Benchmark Result" in job.stdout
    record = json.loads((tmp_path / "job.json").read_text())
    assert (record["completed"], record["failed"]) == (8, 0)
    assert (tmp_path / "job-latency-cdf.png").exists() and (tmp_path / "job-throughput.png").exists()


def test_tune_sweeps_two_by_two_and_restores_the_original_config(ray_head, deployed_config, tiny_checkpoint, tmp_path):
    config_path = tmp_path / "serve.yaml"
    config_path.write_text(yaml.safe_dump(deployed_config))
    result_dir = tmp_path / "results"
    exit_code = serval_main(
        [
            "bench",
            "tune",
            "--config",
            str(config_path),
            "--address",
            ray_head.dashboard_url,
            "--base-url",
            ray_head.base_url,
            "--model",
            LLAMA,
            "--tokenizer",
            tiny_checkpoint("llama"),
            "--max-num-seqs",
            "2",
            "8",
            "--max-num-batched-tokens",
            "512",
            "1024",
            "--random-input-len",
            "32",
            "--random-output-len",
            "8",
            "--num-prompts",
            "12",
            "--max-concurrency",
            "8",
            "--goodput",
            "ttft:60000",
            "tpot:10000",
            "--disable-tqdm",
            "--result-dir",
            str(result_dir),
        ]
    )
    assert exit_code == 0

    [json_path] = result_dir.glob("tune-*.json")
    record = json.loads(json_path.read_text())
    points = record["points"]
    assert sorted((p["max_num_seqs"], p["max_num_batched_tokens"]) for p in points) == [
        (2, 512),
        (2, 1024),
        (8, 512),
        (8, 1024),
    ]
    assert all(p["error"] is None and p["num_failed"] == 0 and p["output_throughput"] > 0 for p in points)
    assert all(set(p["latencies_ms"]) == {"ttft", "tpot"} for p in points)
    within = [p for p in points if p["is_within_slo"]]
    assert record["best"] == max(within, key=lambda p: p["output_throughput"])
    assert (result_dir / f"{json_path.stem}-frontier.png").stat().st_size > 10_000

    # The user's deployment is back as it was.
    deployed = app_status(ray_head)
    assert deployed["status"] == "RUNNING"
    engine_kwargs = deployed["deployed_app_config"]["args"]["llm_configs"][0]["engine_kwargs"]
    assert engine_kwargs["max_num_seqs"] == ORIGINAL_MAX_NUM_SEQS and "max_num_batched_tokens" not in engine_kwargs
